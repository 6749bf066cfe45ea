"""The Turkish word-order task: morphology by hand, grammar of every sentence, layout."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch

from core.catalog.params import EncodingConfigError
from core.spec import SpecError, parse_spec
from worker.data import TASKS, build_task
from worker.data.base import Batch
from worker.data.synthetic import PASSKEY_DEPTHS
from worker.data.turkish import (
    ANIMATE,
    MARKER,
    ORDERS,
    QUESTION,
    THINGS,
    VERBS,
    Roles,
    TurkishWordOrder,
    _draw,
    accusative,
    both_variants,
    dative,
    min_length,
    past,
    sentence,
)

# -- morphology, checked by hand ----------------------------------------------------------


@pytest.mark.parametrize(
    ("word", "softens", "acc", "dat"),
    [
        ("adam", False, "adamı", "adama"),
        ("kedi", False, "kediyi", "kediye"),
        ("köpek", True, "köpeği", "köpeğe"),
        ("çocuk", True, "çocuğu", "çocuğa"),
        ("kitap", True, "kitabı", "kitaba"),
        ("ağaç", True, "ağacı", "ağaca"),
        ("okul", False, "okulu", "okula"),
        ("göz", False, "gözü", "göze"),
        ("kuzu", False, "kuzuyu", "kuzuya"),
        ("öğretmen", False, "öğretmeni", "öğretmene"),
        ("top", False, "topu", "topa"),  # monosyllables mostly keep their consonant
        ("at", False, "atı", "ata"),
        ("elma", False, "elmayı", "elmaya"),
        ("ütü", False, "ütüyü", "ütüye"),
    ],
)
def test_case_suffixes(word: str, softens: bool, acc: str, dat: str) -> None:
    assert accusative(word, softens) == acc
    assert dative(word, softens) == dat


@pytest.mark.parametrize(
    ("stem", "form"),
    [
        ("ver", "verdi"),
        ("sat", "sattı"),
        ("götür", "götürdü"),
        ("göster", "gösterdi"),
        ("yolla", "yolladı"),
        ("koş", "koştu"),
        ("gör", "gördü"),
    ],
)
def test_past_tense(stem: str, form: str) -> None:
    assert past(stem) == form


# -- grammar of the generated sentences -----------------------------------------------------

FORMS: dict[str, tuple[str, str]] = {}  # surface word -> (dictionary form, case)
for noun in ANIMATE:
    FORMS[noun.word] = (noun.word, "nom")
    FORMS[dative(*noun)] = (noun.word, "dat")
for thing in THINGS:
    FORMS[thing.word] = (thing.word, "nom")
    FORMS[accusative(*thing)] = (thing.word, "acc")
PAST = {past(v) for v in VERBS}


def test_the_lexicon_is_unambiguous() -> None:
    # Every surface form names one word in one case (else parsing back would be guesswork).
    assert len(FORMS) == 2 * len(ANIMATE) + 2 * len(THINGS)
    assert not PAST & set(FORMS) and len(PAST) == len(VERBS)
    assert len({n.word for n in ANIMATE} | {t.word for t in THINGS}) == len(ANIMATE) + len(THINGS)


def parse(text: str, variant: str) -> tuple[str, str, str, str]:
    """(agent, recipient, theme, verb) read back from a well-formed sentence, or fail."""
    assert text.endswith(".") and text.count(".") == 1
    *phrases, verb = text[:-1].split(" ")
    assert verb in PAST and len(phrases) == 3
    parsed = [FORMS[p] for p in phrases]
    if variant == "marked":
        cases = {case: word for word, case in parsed}
        assert sorted(case for _, case in parsed) == ["acc", "dat", "nom"]
        assert cases["nom"] in {n.word for n in ANIMATE}  # the agent is a person or animal
        return cases["nom"], cases["dat"], cases["acc"], verb
    # Bare: no suffix anywhere, fixed subject - recipient - object - verb.
    assert [case for _, case in parsed] == ["nom", "nom", "nom"]
    assert parsed[0][0] in {n.word for n in ANIMATE} and parsed[1][0] in {n.word for n in ANIMATE}
    assert parsed[2][0] in {t.word for t in THINGS}
    return parsed[0][0], parsed[1][0], parsed[2][0], verb


def test_a_sentence_by_hand() -> None:
    roles = Roles(agent=0, recipient=1, theme=0, verb=0)  # adam, kadın, kitap, ver
    assert both_variants(roles) == {
        "marked": "adam kadına kitabı verdi.",
        "bare": "adam kadın kitap verdi.",
    }
    assert sentence(roles, "marked", order=5) == "kitabı kadına adam verdi."
    assert sentence(roles, "bare", order=5) == "adam kadın kitap verdi."  # never scrambled
    assert roles.answer() == "adam kadın kitap"


def test_every_sentence_parses_and_both_variants_carry_the_same_roles() -> None:
    generator = torch.Generator().manual_seed(0)
    orders = set()
    for row in torch.rand(3000, 5, generator=generator, dtype=torch.float64).tolist():
        roles, order = _draw(row)
        assert roles.agent != roles.recipient
        orders.add(order)
        said = both_variants(roles, order)
        expected = (
            ANIMATE[roles.agent].word,
            ANIMATE[roles.recipient].word,
            THINGS[roles.theme].word,
            past(VERBS[roles.verb]),
        )
        assert parse(said["marked"], "marked") == expected
        assert parse(said["bare"], "bare") == expected
        assert roles.answer() == " ".join(expected[:3])
    # Scrambling reaches all six orders of subject, recipient and object.
    assert orders == set(range(len(ORDERS))) and len(ORDERS) == 6


# -- examples -------------------------------------------------------------------------------

# Every role tuple that can be said, by brute force: its marked sentence is the longer one.
EVERY_ROLES = [
    roles
    for roles in itertools.starmap(
        Roles,
        itertools.product(
            range(len(ANIMATE)), range(len(ANIMATE)), range(len(THINGS)), range(len(VERBS))
        ),
    )
    if roles.agent != roles.recipient
]
LONGEST_SENTENCE = max(len(sentence(r, "marked").encode()) for r in EVERY_ROLES)
LONGEST_EXAMPLE = max(
    len((MARKER + sentence(r, "marked") + " " + QUESTION + r.answer()).encode())
    for r in EVERY_ROLES
)


def decode_rows(batch: Batch) -> list[tuple[bytes, str]]:
    """(sequence, scored bytes decoded) for every row; the scored bytes end the row."""
    out = []
    for i in range(len(batch.inputs)):
        sequence = bytes(torch.cat([batch.inputs[i, :1], batch.targets[i]]).tolist())
        scored = bytes(batch.targets[i][batch.scored[i]].tolist())
        assert bool(batch.scored[i, -len(scored) :].all())
        out.append((sequence, scored.decode()))
    return out


def rows(task: TurkishWordOrder, length: int, examples: int) -> list[tuple[bytes, str, str]]:
    """(sequence, scored bytes decoded, group) for every evaluation example."""
    out = []
    for batch in task.eval_batches(
        length, protocol="nonoverlapping", batch_size=7, tokens=0, examples=examples
    ):
        out += [(*row, group) for row, group in zip(decode_rows(batch), batch.groups, strict=True)]
    return out


def check(sequence: bytes, scored: str, variant: str, length: int) -> list[tuple[str, str]]:
    """Checks one example's layout and grammar; returns its (marker, sentence) pairs."""
    assert len(sequence) == length + 1
    text = sequence.decode()  # valid UTF-8: no letter cut in half
    body, answer = text.split(QUESTION)
    assert answer == scored
    sentences = re.findall(r"(\* )?([^.]+\.) ", body.lstrip(" "))
    assert "".join(f"{m}{s} " for m, s in sentences) == body.lstrip(" ")
    assert [m for m, _ in sentences].count(MARKER) == 1
    # Leading spaces only where another distractor (and its space) would not have fitted.
    assert len(body) - len(body.lstrip(" ")) <= LONGEST_SENTENCE
    for marker, said in sentences:
        roles = parse(said, variant)
        if marker:
            assert answer == " ".join(roles[:3])
    return sentences


@pytest.mark.parametrize("length", [89, 90, 128, 257, 1000])
def test_examples_are_exactly_length_plus_one_bytes_and_well_formed(length: int) -> None:
    for sequence, scored, group in rows(build_task("sov_tr"), length, examples=30):
        check(sequence, scored, group.split()[0].removeprefix("variant="), length)
    generator = torch.Generator().manual_seed(1)
    for variant in ("marked", "bare"):
        batch = build_task("sov_tr", variant=variant).train_batch(16, length, generator)
        assert batch.inputs.shape == (16, length) and batch.groups == [""] * 16
        for sequence, scored in decode_rows(batch):
            check(sequence, scored, variant, length)


def test_min_length_is_the_shortest_that_always_fits() -> None:
    assert TASKS["sov_tr"].min_length == min_length() == LONGEST_EXAMPLE - 1 == 89
    task = build_task("sov_tr", variant="marked")
    with pytest.raises(ValueError, match="sov_tr needs sequences of at least 89 bytes, got 88"):
        task.example(88, torch.Generator().manual_seed(0), None)


def test_groups_cover_both_variants_and_every_depth() -> None:
    labels = {g for _, _, g in rows(build_task("sov_tr"), 256, examples=40)}
    assert labels == {
        f"variant={v} depth={d:g}" for v in ("marked", "bare") for d in PASSKEY_DEPTHS
    }
    bare = {g for _, _, g in rows(build_task("sov_tr", variant="bare"), 256, examples=10)}
    assert bare == {f"variant=bare depth={d:g}" for d in PASSKEY_DEPTHS}


def test_depth_places_the_target() -> None:
    for sequence, scored, group in rows(build_task("sov_tr"), 512, examples=20):
        variant, depth = (part.split("=")[1] for part in group.split())
        markers = [m for m, _ in check(sequence, scored, variant, 512)]
        assert len(markers) > 8
        at = markers.index(MARKER) / (len(markers) - 1)
        assert at == pytest.approx(float(depth), abs=0.1)


def test_evaluation_examples_are_deterministic_and_paired_across_variants() -> None:
    first = rows(build_task("sov_tr"), 300, examples=20)
    assert first == rows(build_task("sov_tr"), 300, examples=20)
    assert [r for r in first if r[2].startswith("variant=bare")] == rows(
        build_task("sov_tr", variant="bare"), 300, examples=10
    )
    # Example i of a depth asks about the same scene in both variants.
    marked = [(s, g.split()[1]) for _, s, g in first if g.startswith("variant=marked")]
    bare = [(s, g.split()[1]) for _, s, g in first if g.startswith("variant=bare")]
    assert marked == bare and len({s for s, _ in marked}) > 5
    assert rows(build_task("sov_tr"), 301, examples=20) != first


def test_variant_parameter_is_validated() -> None:
    with pytest.raises(
        EncodingConfigError, match="'variant' must be one of 'marked', 'bare', 'both', got 'free'"
    ):
        build_task("sov_tr", variant="free")
    with pytest.raises(ValueError, match="must be one of 'marked', 'bare', 'both', got 'free'"):
        TurkishWordOrder(variant="free")
    assert build_task("sov_tr", variant="bare").variants == ("bare",)
    assert build_task("sov_tr").variants == ("marked", "bare")


def test_specs_use_the_task() -> None:
    base: dict[str, Any] = {"encodings": ["rope"], "model": "tiny", "train": {"length": 128}}
    spec = parse_spec({**base, "task": {"name": "sov_tr", "variant": "marked"}})
    assert spec.task.name == "sov_tr" and spec.task.params == {"variant": "marked"}
    assert spec.task.metric == "accuracy"
    assert parse_spec({**base, "task": "sov_tr"}).task.params == {"variant": "both"}
    with pytest.raises(SpecError, match="'sov_tr' needs sequences of at least 89 bytes"):
        parse_spec({**base, "task": "sov_tr", "train": {"length": 64}})
    with pytest.raises(SpecError, match="'variant' must be one of"):
        parse_spec({**base, "task": {"name": "sov_tr", "variant": "svo"}})


def test_a_study_on_sov_tr_reports_accuracy_by_variant_and_depth(tmp_path) -> None:
    import pandas as pd

    from core import analysis
    from core.settings import get_settings
    from core.spec import parse_spec
    from worker.run import prepared_task, resolve_device, run_study

    spec = parse_spec(
        {
            "name": "turkish",
            "model": "tiny",
            "task": {"name": "sov_tr"},
            "train": {"length": 96, "steps": 3, "batch_size": 2},
            "encodings": ["nope", "rope"],
            "eval": {"lengths": [96, 192], "examples": 20},
        }
    )
    settings = get_settings()
    task = prepared_task(spec, settings.corpus_cache)
    result = run_study(spec, task=task, device=resolve_device(default=settings.device))
    frame = pd.DataFrame(
        {
            "line": run.label,
            "run_id": index,
            "eval_length": row.length,
            "groups": row.groups,
        }
        for index, run in enumerate(result.runs)
        for row in run.evaluations
    )
    by_key = analysis.group_accuracy(frame)
    variants = by_key[by_key["key"] == "variant"]
    assert set(variants["value"]) == {"marked", "bare"}
    assert set(variants["line"]) == {"nope", "rope"} and set(variants["eval_length"]) == {96, 192}
    assert len(by_key[by_key["key"] == "depth"]) == 2 * 2 * len(PASSKEY_DEPTHS)
    assert variants["accuracy"].between(0, 1).all()
    for run in result.runs:
        names = {s.name for s in run.summarize(96, "accuracy")}
        assert "effective_length" in names and "order_sensitivity" not in names  # not lm
