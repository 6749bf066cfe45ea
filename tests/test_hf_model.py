"""HuggingFace models evaluated by posbench (worker/hf): tiny GPT-2, GPT-NeoX (rotary on a
quarter of each head) and Llama models made here with a fixed seed (tests/hf_models.py).

posbench's loss on a set of windows equals HF transformers' own ``model(input_ids,
labels=...)`` on the same windows (float32, to 1e-5), for the non-overlapping and the
sliding protocol, and with each RoPE scaling posbench applies as a variant equal to the
model loaded with that scaling written into its config by hand; bits per byte divide
the nats by the bytes the scored tokens cover; GPT-2 past n_positions is not applicable,
named by its limit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_models import CONTEXT, FAMILIES, MORE_ROPE, build_tokenizer, corpus_text, save_model

from core.catalog.hf_models import HfModelError, ModelPolicy
from core.spec import EvalSpec, VariantSpec
from worker.data.lm import Corpus, LanguageModelling
from worker.evaluate import evaluate_length
from worker.hf.loader import LoadedModel, load_model
from worker.hf.tokens import TokenizedLanguageModelling, token_bytes, tokenize_documents, tokenized

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for family in (*FAMILIES, *MORE_ROPE):
        save_model(root / family, family)
    return root


@pytest.fixture(scope="module")
def loaded(models_root: Path) -> dict[str, LoadedModel]:
    policy = ModelPolicy(roots=(models_root.resolve(),))
    return {family: load_model(family, policy) for family in FAMILIES}


def text_task(tokenizer: Any) -> TokenizedLanguageModelling:
    """The lm task over corpus_text(), its validation split the whole text, tokenized."""
    task = LanguageModelling("text:tiny.txt")
    stream = np.frombuffer(corpus_text(8).encode("utf-8"), dtype=np.uint8)
    task.corpus = Corpus("text:tiny.txt", "test", stream, stream)
    return tokenized(task, tokenizer)


def reference(hf_model, ids: np.ndarray, windows: list[tuple[int, int, int]]) -> tuple[float, int]:
    """(summed nats, scored tokens) of HF transformers' own loss: for each (start, length,
    first scored target) the window ids[start : start + length + 1] is given to the
    model with labels masked (-100) before the scored targets."""
    nats, count = 0.0, 0
    with torch.no_grad():
        for start, length, first in windows:
            input_ids = torch.from_numpy(ids[start : start + length + 1])[None]
            labels = input_ids.clone()
            labels[:, : first + 1] = -100  # label j is the target of position j - 1
            loss = hf_model(input_ids=input_ids, labels=labels).loss
            scored = length - first
            nats += float(loss) * scored
            count += scored
    return nats, count


def nonoverlapping(total: int, length: int) -> list[tuple[int, int, int]]:
    """Disjoint windows from the stream's start scoring targets 1..total (total a multiple
    of length): posbench's plan when the budget covers the whole split."""
    return [(start, length, 0) for start in range(0, total, length)]


def sliding(total: int, length: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows every stride tokens from the start, each scoring its last stride targets
    (every scored token sees length - stride tokens or more), as the YaRN authors'
    perplexity evaluation slides; posbench scores total = N - length targets."""
    return [(start, length, length - stride) for start in range(0, total, stride)]


def posbench_row(model, task, length: int, protocol: str, variant: str = "none", stride=None):
    spec = EvalSpec(
        lengths=[length],
        tokens=1 << 20,
        protocols=[protocol],
        stride=stride,
        variants=[variant],
    )
    return evaluate_length(
        model,
        task,
        spec,
        length=length,
        protocol=protocol,
        variant=VariantSpec.model_validate(variant),
        train_length=CONTEXT,
        device=CPU,
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("protocol", "length", "stride"), [("nonoverlapping", 16, None), ("sliding", 16, 4)]
)
def test_the_loss_is_hf_transformers_own_on_the_same_windows(
    loaded: dict[str, LoadedModel], family: str, protocol: str, length: int, stride: int | None
) -> None:
    model = loaded[family]
    task = text_task(model.tokenizer)
    # A whole number of windows (the last one full): the budget covers every target.
    usable = (len(task.ids) - length) // length * length
    task.ids, task.bytes = task.ids[: usable + length], task.bytes[: usable + length]
    row = posbench_row(model.model, task, length, protocol, stride=stride)
    windows = (
        nonoverlapping(usable, length)
        if protocol == "nonoverlapping"
        else sliding(usable, length, stride or length)
    )
    nats, count = reference(model.model.hf, task.ids, windows)
    assert row.tokens == count == usable
    assert row.loss == pytest.approx(nats / count, abs=1e-5)
    assert row.perplexity == pytest.approx(math.exp(nats / count), rel=1e-5)
    # Bits per byte: the nats over ln 2 x the bytes of text the scored tokens cover.
    if protocol == "nonoverlapping":
        covered = int(task.bytes[1 : usable + 1].sum())
    else:
        first = length - stride + 1  # the first scored target
        covered = int(task.bytes[first : first + usable].sum())
    assert row.bits_per_byte == pytest.approx(nats / (math.log(2) * covered), rel=1e-5)
    assert covered > count  # this tokenizer's tokens are more than a byte on average


# The HF rope parameters each variant stands for, written out by hand (base 10000, the
# original length 32, `pairs` rotated pairs) as a model's config would carry them.
def hand_written(variant: str, pairs: int) -> dict[str, Any]:
    r = 2 * pairs
    original = {"original_max_position_embeddings": CONTEXT}
    return {
        "pi:4": {"rope_type": "linear", "factor": 4.0},
        "linear:2": {"rope_type": "linear", "factor": 2.0},
        "ntk:4": {"rope_type": "default", "rope_theta": 1e4 * 4.0 ** (r / (r - 2))},
        "dynamic:2": {"rope_type": "dynamic", "factor": 2.0},
        "dynamic_ntk": {"rope_type": "dynamic", "factor": 1.0},
        "yarn:4": {"rope_type": "yarn", "factor": 4.0, **original},
        "yarn:auto": {"rope_type": "yarn", "factor": 64 / CONTEXT, **original},
        "longrope:4": {
            "rope_type": "longrope",
            "factor": 4.0,
            "short_factor": [1.0] * pairs,
            "long_factor": [4.0] * pairs,
            **original,
        },
        "llama3:4": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            **original,
        },
    }[variant]


def hf_model_with(folder: Path, rope: dict[str, Any]):
    """The saved model, loaded by HF transformers with ``rope`` as its rope parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    fraction = config.rope_parameters.get("partial_rotary_factor")
    config.rope_parameters = {
        "rope_theta": 1e4,
        **({"partial_rotary_factor": fraction} if fraction else {}),
        **rope,
    }
    return AutoModelForCausalLM.from_pretrained(
        folder, config=config, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


VARIANTS = [
    "pi:4",
    "linear:2",
    "ntk:4",
    "dynamic:2",
    "dynamic_ntk",
    "yarn:4",
    "yarn:auto",
    "longrope:4",
    "llama3:4",
]


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_rope_scaling_is_the_model_with_that_scaling_in_its_config(
    models_root: Path, loaded: dict[str, LoadedModel], family: str, variant: str
) -> None:
    model = loaded[family]
    task = text_task(model.tokenizer)
    length = 2 * CONTEXT  # past the original length, where scalings change the model
    usable = (len(task.ids) - length) // length * length
    task.ids, task.bytes = task.ids[: usable + length], task.bytes[: usable + length]
    pairs = model.facts.rotary.rotary_dim // 2
    assert pairs == (2 if family == "gpt_neox" else 8)  # rotary_pct 0.25 of 16 dimensions
    plain = posbench_row(model.model, task, length, "nonoverlapping")
    scaled = posbench_row(model.model, task, length, "nonoverlapping", variant)
    theirs = hf_model_with(models_root / family, hand_written(variant, pairs))
    nats, count = reference(theirs, task.ids, nonoverlapping(usable, length))
    assert scaled.loss == pytest.approx(nats / count, abs=1e-5)
    assert abs(scaled.loss - plain.loss) > 1e-7  # the scaling changed the model...
    again = posbench_row(model.model, task, length, "nonoverlapping")
    assert again.loss == plain.loss  # ...for the variant's evaluation only


def test_gpt2_past_n_positions_is_not_applicable_named_by_its_limit(
    loaded: dict[str, LoadedModel],
) -> None:
    model = loaded["gpt2"]
    task = text_task(model.tokenizer)
    row = posbench_row(model.model, task, 2 * CONTEXT, "nonoverlapping")
    assert row.not_applicable == f"not applicable: gpt2 learned positions end at {CONTEXT} (L=32)"
    assert row.loss is None and row.bits_per_byte is None and row.tokens == 0
    at_the_end = posbench_row(model.model, task, CONTEXT, "nonoverlapping")
    assert at_the_end.not_applicable is None and at_the_end.loss > 0
    with pytest.raises(HfModelError, match=r"learned positions end at 32 \(n_positions\)"):
        model.model(torch.zeros(1, CONTEXT + 1, dtype=torch.long))
    scaled = model.model.scaled("yarn", 2.0, CONTEXT)
    with pytest.raises(HfModelError, match="RoPE scalings apply to RoPE models"), scaled:
        pass


def test_each_token_carries_the_bytes_it_covers() -> None:
    tokenizer = build_tokenizer()
    documents = ["Hello wörld 😀 and more", "def f(x):\n    return x\n", ""]
    ids, sizes, spans = tokenize_documents(tokenizer, documents)
    # Every byte once, and the end-of-text token between documents covers their NUL.
    assert int(sizes.sum()) == sum(len(d.encode()) for d in documents) + 2
    separators = np.flatnonzero(ids == tokenizer.eos_token_id)
    assert len(separators) == 2 and (sizes[separators] == 1).all()
    # Each document's span holds exactly its own tokens (the document protocol's unit).
    for (start, end), document in zip(spans.tolist(), documents, strict=True):
        own = tokenizer.backend_tokenizer.encode(document, add_special_tokens=False).ids
        assert ids[start:end].tolist() == own
    assert spans[1:, 0].tolist() == (separators + 1).tolist()
    # A character split over byte tokens: the first token ending it covers its bytes.
    text = "😀"
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    assert token_bytes(text, encoding.offsets).tolist()[0] == 4
    assert token_bytes(text, encoding.offsets).sum() == 4
    assert token_bytes("ab", [(0, 1), (1, 2)]).tolist() == [1, 1]
    assert token_bytes(" é x", [(1, 2), (3, 4)]).tolist() == [3, 2]  # spaces go with what follows


def test_a_split_too_short_for_the_longest_length_is_refused_in_tokens(
    loaded: dict[str, LoadedModel],
) -> None:
    task = text_task(loaded["llama"].tokenizer)
    longest = len(task.ids)
    with pytest.raises(ValueError, match=f"needs at least {longest + 1}"):
        task.check_plan(EvalSpec(lengths=[longest]))
    task.check_plan(EvalSpec(lengths=[longest - 1], tokens=64))


def test_weights_come_from_safetensors_only(models_root: Path) -> None:
    import shutil

    pickled = models_root / "pickled"
    shutil.copytree(models_root / "llama", pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    policy = ModelPolicy(roots=(models_root.resolve(),))
    with pytest.raises(HfModelError, match=r"no model.safetensors and no model.safetensors.index"):
        load_model("pickled", policy)
    with pytest.raises(HfModelError, match="not inside the models roots"):
        load_model(str(models_root), ModelPolicy(roots=(models_root.resolve() / "llama",)))


def test_the_model_attends_by_pytorchs_sdpa(loaded: dict[str, LoadedModel]) -> None:
    for family, model in loaded.items():
        assert model.model.hf.config._attn_implementation == "sdpa", family
        assert model.model.hf.training is False  # evaluation mode: no dropout


@pytest.mark.parametrize("family", MORE_ROPE)
@pytest.mark.parametrize("variant", ["none", "yarn:4"])
def test_mistral_and_qwen2_are_evaluated_like_llama(
    models_root: Path, family: str, variant: str
) -> None:
    model = load_model(family, ModelPolicy(roots=(models_root.resolve(),)))
    assert (model.facts.encoding, model.facts.rotary.rotary_dim) == ("rope", 16)
    task = text_task(model.tokenizer)
    length = 2 * CONTEXT
    usable = (len(task.ids) - length) // length * length
    task.ids, task.bytes = task.ids[: usable + length], task.bytes[: usable + length]
    row = posbench_row(model.model, task, length, "nonoverlapping", variant)
    theirs = (
        model.model.hf
        if variant == "none"
        else hf_model_with(models_root / family, hand_written(variant, 8))
    )
    nats, count = reference(theirs, task.ids, nonoverlapping(usable, length))
    assert row.loss == pytest.approx(nats / count, abs=1e-5)
