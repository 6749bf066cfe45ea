"""The synthetic tasks for HuggingFace models (worker/hf/answers.py): each task's examples,
drawn by the task's own code, in a model's tokens.

Tokenizers trained here in the manner of GPT-2's, GPT-NeoX's and Llama's
(tests/hf_models.py: byte-level BPE with offsets trimmed or not, SentencePiece-style BPE
with a prefix space, digits one by one and byte fallback) give examples of exactly the
requested length whose scored tokens are the answer a program reads back from the
prompt; the same seed gives the same examples; posbench's accuracy on tiny GPT-2,
GPT-NeoX and Llama models equals exact match computed directly from
``model(input_ids).logits.argmax(-1)``; and ``posbench run`` evaluates an hf: model on
passkey with accuracy by depth."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import isolated_env, posbench_cli
from hf_models import CONTEXT, FAMILIES, family_tokenizer, save_model
from test_algorithmic_tasks import oracle as algorithmic_oracle
from test_ruler_tasks import read_common, read_niah, read_tracking

from core.catalog import tasks as catalogue
from core.catalog.hf_models import ModelPolicy
from core.catalog.tasks import TaskConfigError
from core.spec import EvalSpec, SpecError, VariantSpec, parse_spec
from worker.data import TASKS, build_task
from worker.data.synthetic import PASSKEY_DEPTHS
from worker.data.synthetic import QUESTION as PASSKEY_QUESTION
from worker.data.turkish import QUESTION as TURKISH_QUESTION
from worker.evaluate import _Accumulator, evaluate_length
from worker.hf.answers import TokenizedSynthetic, answer_tokens
from worker.hf.loader import LoadedModel, load_model

CPU = torch.device("cpu")
SYNTHETIC = [n for n, entry in TASKS.items() if entry.kind.name == "ANSWER" and entry.text]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    return {family: family_tokenizer(family) for family in FAMILIES}


# What each task's prompt ends with, and its answer read back from the text (not from
# the scored tokens): the pass key of the needle, the copied string, the queried key's
# value, the role words after the question.
def read_passkey(text: str) -> tuple[str, str]:
    needle = re.search(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\. ", text)
    assert needle is not None and text.endswith(PASSKEY_QUESTION + needle.group(1))
    return "The pass key is", needle.group(1)


def read_copy(text: str) -> tuple[str, str]:
    source, copied = text.split("|")
    assert copied == source.strip()
    return "|", source.strip()


def read_assoc_recall(text: str) -> tuple[str, str]:
    body, query = text.strip().split("?")
    pairs = dict(pair.split("=") for pair in body.strip(";").split(";"))
    key, value = query.split("=")
    assert len(pairs) == body.count(";") and pairs[key] == value
    return "=", pairs[key]


def read_sov_tr(text: str) -> tuple[str, str]:
    body, answer = text.split(TURKISH_QUESTION)
    target = re.search(r"\* ([^.]+)\.", body)
    assert target is not None and len(answer.split()) == 3
    words = target.group(1).split()
    if words[:3] == answer.split():  # the bare variant: roles by position
        assert len(words) == 4
    return TURKISH_QUESTION.strip(), answer


def read_asked(oracle: Any) -> Any:
    """A RULER-style task's reader: its oracle (tests/test_ruler_tasks.py) on the prompt."""

    def read(text: str) -> tuple[str, str]:
        prompt = text[: text.rindex("? ") + 2]
        answer = oracle(prompt)
        assert answer is not None and text == prompt + answer
        return "?", answer

    return read


def read_algorithmic(name: str) -> Any:
    """An algorithmic task's reader: its oracle (tests/test_algorithmic_tasks.py) on the
    prompt, up to its last ``=`` (arithmetic, parity) or ``|`` (string tasks)."""

    def read(text: str) -> tuple[str, str]:
        marker = "|" if "|" in text else "="
        prompt = text[: text.rindex(marker) + 1]
        answer = algorithmic_oracle(name, {}, prompt)
        assert text == prompt + answer
        return marker, answer

    return read


ALGORITHMIC = ("addition", "binary_addition", "parity", "reverse", "duplicate", "sort")

READ = {
    "passkey": read_passkey,
    "copy": read_copy,
    "assoc_recall": read_assoc_recall,
    "sov_tr": read_sov_tr,
    "niah": read_asked(read_niah),
    "variable_tracking": read_asked(read_tracking),
    "common_words": read_asked(read_common),
    **{name: read_algorithmic(name) for name in ALGORITHMIC},
}


# common_words' list grows by whole words (several tokens each): the nearest byte budget
# can fall further short in tokens.
LOOSE = {"common_words": 48}


def rows(task: TokenizedSynthetic, length: int, examples: int) -> list[tuple[Any, ...]]:
    """(token ids of the whole example, scored targets, group) of every evaluation example."""
    out = []
    for batch in task.eval_batches(
        length, protocol="nonoverlapping", batch_size=7, tokens=0, examples=examples
    ):
        assert batch.inputs.shape[1] == length and batch.inputs.dtype == torch.long
        for i in range(len(batch.inputs)):
            ids = torch.cat([batch.inputs[i, :1], batch.targets[i]])
            out.append((ids, batch.scored[i], batch.groups[i]))
    return out


def test_every_task_in_the_catalogue_is_covered() -> None:
    assert sorted(READ) == sorted(SYNTHETIC)
    # frequent_words' Zipf counts (so its words) change with the length: no byte budget
    # comes near a count of tokens, so it is not offered to hf: models.
    assert [name for name, entry in TASKS.items() if not entry.text] == ["frequent_words"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", SYNTHETIC)
def test_examples_are_exactly_the_requested_tokens_and_score_their_answer(
    tokenizers: dict[str, Any], family: str, name: str
) -> None:
    tokenizer = tokenizers[family]
    task = TokenizedSynthetic(build_task(name), tokenizer)
    pad = tokenizer.eos_token_id
    # The task's shortest length and one more: a token before the text (SentencePiece's
    # prefix space) can make the shortest example one token longer than its bytes.
    for length in (TASKS[name].min_length + 1, 300, 1000):
        drawn = rows(task, length, examples=20)
        assert len(drawn) == task.task.per_group(20) * len(task.task.groups())
        for ids, scored, _ in drawn:
            assert len(ids) == length + 1
            # End-of-text tokens only before the text, where no byte budget fitted exactly.
            padding = int((ids != pad).long().argmax())
            assert pad not in ids[padding:].tolist() and padding < LOOSE.get(name, 20)
            # The scored targets are the last ones, and they are the answer.
            count = int(scored.sum())
            assert count >= 1 and bool(scored[-count:].all())
            text = tokenizer.decode(ids[padding:])
            prompt_end, answer = READ[name](text)
            assert tokenizer.decode(ids[-count:]).strip() == answer
            # The token before them carries no character of the answer.
            assert tokenizer.decode(ids[padding:-count]).rstrip().endswith(prompt_end)
        if name == "passkey":
            # The filler's text meets the length exactly: no padding.
            assert not any(int(ids[0] == pad) for ids, _, _ in drawn)


def test_answer_tokens_are_those_that_carry_its_characters() -> None:
    # "is 42": a space token of its own stays in the prompt; one that starts the answer
    # (offsets trimmed or not) is scored; every byte token of a split character is.
    assert answer_tokens([(0, 2), (2, 3), (3, 5)], 3) == 1
    assert answer_tokens([(0, 2), (3, 5)], 3) == 1
    assert answer_tokens([(0, 2), (2, 5)], 3) == 1
    assert answer_tokens([(0, 2), (2, 3), (3, 4), (3, 4), (4, 5)], 3) == 3
    assert answer_tokens([(0, 2), (2, 2), (3, 4)], 3) == 1


def test_the_same_seed_gives_the_same_examples(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["gpt2"]
    for name in SYNTHETIC:
        first = TokenizedSynthetic(build_task(name), tokenizer)
        drawn = rows(first, 400, examples=20)
        again = rows(first, 400, examples=20)  # drawn again from the kept byte budgets
        fresh = rows(TokenizedSynthetic(build_task(name), tokenizer), 400, examples=20)
        for one, other in ((drawn, again), (drawn, fresh)):
            assert all(
                torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
                for a, b in zip(one, other, strict=True)
            )
        assert [r[0].tolist() for r in rows(first, 401, examples=20)] != [
            r[0].tolist() for r in drawn
        ]


def test_pass_keys_are_those_of_the_byte_level_examples_at_that_length(
    tokenizers: dict[str, Any],
) -> None:
    # The generator is seeded by the task and the length, as for byte-level models: the
    # keys (drawn first) are the same, whatever the tokenizer and the byte budget.
    length = 512
    byte_level = build_task("passkey")
    keys = [
        read_passkey(bytes(seq).decode())[1] for seq, _, _ in byte_level.eval_examples(length, 4)
    ]
    for tokenizer in tokenizers.values():
        task = TokenizedSynthetic(build_task("passkey"), tokenizer)
        drawn = rows(task, length, examples=20)
        scored = [tokenizer.decode(ids[-int(s.sum()) :]).strip() for ids, s, _ in drawn]
        assert scored == keys
        assert [g for _, _, g in drawn] == [
            f"depth={d:g}" for d in PASSKEY_DEPTHS for _ in range(4)
        ]


def test_turkish_examples_ask_about_the_same_scene_in_both_variants(
    tokenizers: dict[str, Any],
) -> None:
    tokenizer = tokenizers["llama"]
    drawn = rows(TokenizedSynthetic(build_task("sov_tr"), tokenizer), 300, examples=20)
    answers: dict[str, list[str]] = {"marked": [], "bare": []}
    for ids, scored, group in drawn:
        count = int(scored.sum())
        answers[group.split()[0].removeprefix("variant=")].append(tokenizer.decode(ids[-count:]))
    assert answers["marked"] == answers["bare"] and len(set(answers["bare"])) > 3


def test_a_length_too_short_in_tokens_is_refused_naming_it(tokenizers: dict[str, Any]) -> None:
    task = TokenizedSynthetic(build_task("passkey"), tokenizers["gpt2"])
    with pytest.raises(TaskConfigError, match=r"its shortest example is \d+ tokens .* length 20"):
        task.check_plan(EvalSpec(lengths=[20, 256]))
    task.check_plan(EvalSpec(lengths=[128, 256]))
    copy = TokenizedSynthetic(build_task("copy"), tokenizers["llama"])
    with pytest.raises(TaskConfigError, match=r"shortest example is 9 tokens .* length 8 cannot"):
        copy.check_plan(EvalSpec(lengths=[8], examples=20))
    copy.check_plan(EvalSpec(lengths=[9], examples=20))
    # More distinct keys than the key length has, once the text is counted in tokens.
    recall = TokenizedSynthetic(build_task("assoc_recall", key_length=1), tokenizers["gpt2"])
    with pytest.raises(TaskConfigError, match="has only 26 distinct keys"):
        recall.check_plan(EvalSpec(lengths=[128]))
    with pytest.raises(TaskConfigError, match="evaluated, never trained"):
        task.train_batch(2, 128, torch.Generator())


# -- accuracy against HF transformers' own argmax ------------------------------------------


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """The tiny models with a context of 256 positions (GPT-2's learned table holds the
    examples), their output layer biased towards digit tokens: their argmax is a digit
    that depends on the input, so answers of digits are sometimes right."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for family in FAMILIES:
        save_model(root / family, family, context=256)
        model = load_model(family, ModelPolicy(roots=(root.resolve(),)))
        vocabulary = model.tokenizer.convert_ids_to_tokens(list(range(len(model.tokenizer))))
        digits = [
            i
            for i, token in enumerate(vocabulary)
            if token.lstrip("Ġ▁") and set(token.lstrip("Ġ▁")) <= set("0123456789")
        ]
        head = model.model.hf.get_output_embeddings()
        bias = torch.zeros(head.weight.shape[0])
        bias[digits] = 50.0
        head.bias = torch.nn.Parameter(bias)
        out[family] = model
    return out


def reference(hf_model, tokenizer, drawn, name: str) -> tuple[list[bool], int, int]:
    """Exact match of each example from ``hf_model(input_ids).logits.argmax(-1)``: the
    answer's tokens are the fewest last ones that decode to the answer read back from
    the text; (right or not per example, right answer tokens, answer tokens)."""
    exact, right, total = [], 0, 0
    with torch.no_grad():
        for ids, _, _ in drawn:
            text = tokenizer.decode(ids[ids != tokenizer.eos_token_id])
            answer = READ[name](text)[1]
            count = next(
                k for k in range(1, len(ids)) if tokenizer.decode(ids[-k:]).strip() == answer
            )
            predicted = hf_model(input_ids=ids[None, :-1]).logits.argmax(-1)[0]
            hits = predicted[-count:] == ids[-count:]
            exact.append(bool(hits.all()))
            right += int(hits.sum())
            total += count
    return exact, right, total


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("name", "params"), [("passkey", {"digits": 1}), ("assoc_recall", {})])
def test_accuracy_is_exact_match_of_the_models_own_argmax(
    loaded: dict[str, LoadedModel], family: str, name: str, params: dict[str, Any]
) -> None:
    model = loaded[family]
    task = TokenizedSynthetic(build_task(name, **params), model.tokenizer)
    any_right = 0
    for length in (128, 255):
        spec = EvalSpec(lengths=[length], examples=50)
        row = evaluate_length(
            model.model,
            task,
            spec,
            length=length,
            protocol="nonoverlapping",
            variant=VariantSpec(),
            train_length=256,
            device=CPU,
        )
        drawn = rows(task, length, examples=50)
        exact, right, total = reference(model.model.hf, model.tokenizer, drawn, name)
        assert row.accuracy == sum(exact) / len(exact)
        assert row.tokens == total and row.token_accuracy == right / total
        # One part: RULER's metrics are exact match.
        assert row.string_match_all == row.string_match_part == row.accuracy
        groups: dict[str, list[bool]] = {}
        for (_, _, group), hit in zip(drawn, exact, strict=True):
            if group:
                groups.setdefault(group, []).append(hit)
        assert row.groups == {g: sum(h) / len(h) for g, h in sorted(groups.items())}
        any_right += sum(exact)
    if name == "passkey":
        # Some pass keys right and some wrong: the comparison says something.
        assert 0 < any_right < 100
        assert set(row.groups) == {f"depth={d:g}" for d in PASSKEY_DEPTHS}


# -- the spec and posbench run ---------------------------------------------------------------


def hf_spec(**changes: Any) -> dict[str, Any]:
    base = {
        "name": "hf passkey",
        "model": {"hf": "llama"},
        "task": "passkey",
        "train": {"length": CONTEXT},
        "eval": {"lengths": [128, 256], "examples": 10},
    }
    return {**base, **changes}


def test_the_spec_takes_text_tasks_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SYNTHETIC:
        length = max(256, TASKS[name].min_length)
        study = parse_spec(hf_spec(task=name, eval={"lengths": [length], "examples": 10}))
        assert study.task.name == name and study.runs()[0].encoding.label == "hf:llama"
    # Synthetic tasks score each example whole: no sliding windows, as for posbench's models.
    with pytest.raises(SpecError, match="'sliding' applies to language modelling, not 'passkey'"):
        parse_spec(hf_spec(eval={"lengths": [256], "protocols": ["sliding"], "stride": 64}))
    # Lengths count tokens; train.length is the model's context, never a sequence read.
    with pytest.raises(SpecError, match=r"at least 128 tokens; eval\.lengths is 64"):
        parse_spec(hf_spec(eval={"lengths": [64]}))
    # A task whose examples are not text is refused, naming those that are.
    entry = dataclasses.replace(TASKS["copy"], text=False)
    monkeypatch.setitem(catalogue.TASKS, "copy", entry)
    with pytest.raises(SpecError) as refused:
        parse_spec(hf_spec(task="copy"))
    assert "task 'copy': its examples are not text" in str(refused.value)
    assert "(tasks for model.hf: lm, passkey, assoc_recall, sov_tr, niah, " in str(refused.value)


def test_posbench_run_scores_an_hf_model_on_passkey_by_depth(tmp_path: Path) -> None:
    home = tmp_path / "home"
    save_model(home / "models" / "llama", "llama")
    spec_file = tmp_path / "study.json"
    spec_file.write_text(json.dumps(hf_spec()))
    out = tmp_path / "out"
    env = isolated_env(home, POSBENCH_MODELS_ROOTS=str(home / "models"), POSBENCH_DEVICE="cpu")
    done = posbench_cli("run", str(spec_file), "--json", "--out", str(out), env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    assert (run["label"], run["train"]["steps"]) == ("hf:llama", 0)
    assert [e["length"] for e in run["evaluations"]] == [128, 256]
    for point in run["evaluations"]:
        assert point["protocol"] == "nonoverlapping" and point["not_applicable"] is None
        assert 0.0 <= point["accuracy"] <= point["token_accuracy"] <= 1.0
        assert set(point["groups"]) == {f"depth={d:g}" for d in PASSKEY_DEPTHS}
        assert point["tokens"] == 10 * 5  # 2 examples per depth, a digit a token here
        assert point["perplexity"] is None
    model = run["provenance"]["model"]
    assert len(model["tokenizer_sha256"]) == 16 and model["model_type"] == "llama"
    assert (out / "results.json").exists()


# -- RULER's answer parts in tokens ----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_answer_part_is_the_tokens_that_carry_its_characters(
    tokenizers: dict[str, Any], family: str
) -> None:
    """niah with three values: each part's targets are the tokens whose characters (the
    tokenizer's own offsets of the decoded text) meet the value read from the prompt,
    and a wrong token costs the parts it carries."""
    tokenizer = tokenizers[family]
    task = TokenizedSynthetic(build_task("niah", num_values=3), tokenizer)
    pad, checked = tokenizer.eos_token_id, 0
    for batch in task.eval_batches(
        300, protocol="nonoverlapping", batch_size=7, tokens=0, examples=10
    ):
        assert batch.parts is not None and batch.parts.shape[1:] == (300, 3)
        wrong = torch.zeros_like(batch.targets, dtype=torch.bool)
        expected = 0.0
        for row in range(len(batch.inputs)):
            ids = torch.cat([batch.inputs[row, :1], batch.targets[row]])
            assert READ["niah"](tokenizer.decode(ids[ids != pad]))
            # The last tokens from the question on, which read back as themselves (a
            # haystack's run of spaces may not: a decoder can fold it).
            tail = next(
                ids[-k:].tolist()
                for k in range(40, 0, -1)
                if tokenizer(tokenizer.decode(ids[-k:]), add_special_tokens=False)["input_ids"]
                == ids[-k:].tolist()
                and "What is" in tokenizer.decode(ids[-k:])
            )
            padding = 301 - len(tail)
            text = tokenizer.decode(tail)
            answer = text.rsplit("? ", 1)[1]
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            start, masks = len(text) - len(answer), []
            for part in answer.split(", "):
                at = text.index(part, start)
                start = at + len(part)
                mask = torch.zeros(300, dtype=torch.bool)
                for j, (low, high) in enumerate(encoded["offset_mapping"]):
                    if low < start and high > at:
                        mask[padding + j - 1] = True  # target of input position j - 1
                masks.append(mask)
            assert torch.equal(batch.parts[row], torch.stack(masks, -1))
            # The last token of the last part wrong: every part it carries is wrong.
            last = int(masks[2].nonzero()[-1])
            wrong[row, last] = True
            expected += (3 - sum(bool(m[last]) for m in masks)) / 3
            checked += 1
        accumulator = _Accumulator(300)
        predicted = torch.where(wrong, (batch.targets + 1) % len(tokenizer), batch.targets)
        accumulator.add(torch.nn.functional.one_hot(predicted, len(tokenizer)).float(), batch)
        assert accumulator.exact == 0
        assert accumulator.parts_all == pytest.approx(expected)
    assert checked == 10


@pytest.mark.parametrize("family", FAMILIES)
def test_niah_with_a_text_haystack_in_tokens(tokenizers: dict[str, Any], family: str) -> None:
    """Lines of the pystdlib corpus in a model's tokens: exactly the length, the scored
    tokens the value a program reads back from the prompt."""
    tokenizer = tokenizers[family]
    task = TokenizedSynthetic(build_task("niah", haystack="text"), tokenizer)
    pad = tokenizer.eos_token_id
    drawn = rows(task, 400, examples=10)
    assert len(drawn) == 10
    for ids, scored, _ in drawn:
        assert len(ids) == 401
        count = int(scored.sum())
        answer = READ["niah"](tokenizer.decode(ids[ids != pad]))[1]
        assert tokenizer.decode(ids[-count:]).strip() == answer
