"""Tasks and corpora: generators, scorers, splits and the evaluation protocols."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from core.catalog.corpora import SourcePolicy
from worker.data import build_task
from worker.data.lm import (
    MAX_BLOCKS,
    CorpusError,
    is_validation,
    load_corpus,
    read_documents,
    scored_blocks,
    window_plan,
)
from worker.data.synthetic import PASSKEY_DEPTHS, QUESTION
from worker.evaluate import _Accumulator, log_bins


def decode(row: torch.Tensor) -> str:
    return bytes(row.tolist()).decode()


def rooted(root: Path, **rules) -> SourcePolicy:
    """The rules of a service whose corpus root is ``root`` (HuggingFace on)."""
    return SourcePolicy(roots=(root.resolve(),), hf_enabled=True, **rules)


# -- corpora ------------------------------------------------------------------------------


def test_pystdlib_split_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    train, valid = read_documents("pystdlib")
    again_train, again_valid = read_documents("pystdlib")
    assert [d.path for d in train] == [d.path for d in again_train]
    assert [d.path for d in valid] == [d.path for d in again_valid]
    assert not {d.path for d in train} & {d.path for d in valid}
    assert all(is_validation(d.path) for d in valid)
    assert 0.02 < len(valid) / (len(train) + len(valid)) < 0.10
    corpus = load_corpus("pystdlib", tmp_path)
    assert len(corpus.train) > 5_000_000 and len(corpus.valid) > 200_000  # multi-megabyte
    # Prepared once: the second load memory-maps the same content-addressed files.
    assert load_corpus("pystdlib", tmp_path).fingerprint == corpus.fingerprint
    assert len(list((tmp_path / "corpora").iterdir())) == 1


def test_text_corpus_file_folder_and_errors(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i} " * 50)
    corpus = load_corpus(f"text:{folder}", tmp_path / "cache", rooted(tmp_path))
    assert len(corpus.train) + len(corpus.valid) > 40 * 500
    single = tmp_path / "one.txt"
    single.write_text("abcdefghij" * 1000)
    one = load_corpus(f"text:{single}", tmp_path / "cache", rooted(tmp_path))
    # A lone document is split by position: 95% / 5%.
    assert len(one.valid) == 500 and bytes(one.train[:10]) == b"abcdefghij"
    (folder / "binary.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CorpusError, match=r"binary.bin is not UTF-8 \(byte 0\)"):
        load_corpus(f"text:{folder}", tmp_path / "cache", rooted(tmp_path))
    with pytest.raises(CorpusError, match="no such file or folder"):
        load_corpus(f"text:{tmp_path / 'missing'}", tmp_path / "cache", rooted(tmp_path))
    with pytest.raises(CorpusError, match=r"unknown corpus 'wiki' \(allowed: pystdlib"):
        load_corpus("wiki", tmp_path / "cache")


def test_content_change_invalidates_the_cache(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("first version " * 100)
    before = load_corpus(f"text:{text}", tmp_path / "cache", rooted(tmp_path)).fingerprint
    text.write_text("second version " * 100)
    assert load_corpus(f"text:{text}", tmp_path / "cache", rooted(tmp_path)).fingerprint != before


def test_huggingface_loader_on_a_local_dataset(tmp_path: Path) -> None:
    dataset = tmp_path / "tiny_wiki"
    dataset.mkdir()
    for split, count in (("train", 30), ("validation", 5)):
        with (dataset / f"{split}.jsonl").open("w") as handle:
            for i in range(count):
                handle.write(json.dumps({"id": i, "text": f"{split} article {i}. " * 20}) + "\n")
    corpus = load_corpus(f"hf:{dataset}", tmp_path / "cache", rooted(tmp_path))
    assert bytes(corpus.train[:15]) == b"train article 0"
    assert bytes(corpus.valid[:20]) == b"validation article 0"
    assert len(corpus.valid) == 5 * len("validation article 0. ") * 20 + 4  # 4 separators
    (tmp_path / "no_valid").mkdir()
    (tmp_path / "no_valid" / "train.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(CorpusError, match="needs a 'validation' split"):
        load_corpus(f"hf:{tmp_path / 'no_valid'}", tmp_path / "cache", rooted(tmp_path))


def _local_dataset(folder: Path, rows: dict[str, list[dict]]) -> Path:
    folder.mkdir()
    for split, records in rows.items():
        with (folder / f"{split}.jsonl").open("w") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
    return folder


def test_huggingface_text_column_is_chosen_by_name_not_position(tmp_path: Path) -> None:
    # PG-19's columns: short_book_title, publication_date, url, text.
    book = {"short_book_title": "A Title", "publication_date": 1900, "url": "http://x"}
    pg19 = _local_dataset(
        tmp_path / "pg19",
        {
            split: [{**book, "text": f"{split} book {i} " * 30} for i in range(n)]
            for split, n in (("train", 12), ("validation", 3))
        },
    )
    corpus = load_corpus(f"hf:{pg19}", tmp_path / "cache", rooted(tmp_path))
    assert bytes(corpus.train[:12]) == b"train book 0" and b"A Title" not in bytes(corpus.train)
    titles = load_corpus(f"hf:{pg19}::short_book_title", tmp_path / "cache", rooted(tmp_path))
    assert bytes(titles.valid) == b"\0".join([b"A Title"] * 3)
    with pytest.raises(CorpusError, match="has no text column 'body' \\(its text columns: "):
        load_corpus(f"hf:{pg19}::body", tmp_path / "cache", rooted(tmp_path))
    two = _local_dataset(
        tmp_path / "two",
        {s: [{"title": "t", "body": "b"}] * 4 for s in ("train", "validation")},
    )
    with pytest.raises(CorpusError, match=r"several text columns \(title, body\)"):
        load_corpus(f"hf:{two}", tmp_path / "cache", rooted(tmp_path))


def test_huggingface_rows_that_are_lines_make_one_stream(tmp_path: Path) -> None:
    # WikiText: one row per line (blank lines are empty rows), not one per document.
    lines = ["", " = Valkyria Chronicles = \n", "", " The game began in 2010 . \n"]
    wiki = _local_dataset(
        tmp_path / "wiki", {s: [{"text": line} for line in lines * 5] for s in ("train", "test")}
    )
    corpus = load_corpus(f"hf:{wiki}", tmp_path / "cache", rooted(tmp_path))
    stream = (" = Valkyria Chronicles = \n The game began in 2010 . \n" * 5).encode()
    assert bytes(corpus.valid) == stream  # no NUL between lines
    assert b"\0" not in bytes(corpus.train)


# -- protocols ----------------------------------------------------------------------------


def test_nonoverlapping_windows_by_hand() -> None:
    # 30 targets in three 10-byte stretches spread over targets 1..90 (the last window
    # must fit: 100 - 10): targets 1-10, 41-50, 81-90.
    plan = window_plan(
        valid_bytes=100, length=10, protocol="nonoverlapping", tokens=30, stride=None
    )
    assert plan.starts.tolist() == [0, 40, 80] and plan.scored.tolist() == [10, 10, 10]
    # Capped by what the validation split holds at the longest length: 100 - 10 bytes.
    plan = window_plan(100, 10, "nonoverlapping", tokens=1000, stride=None)
    assert plan.starts.tolist() == [0, 10, 20, 30, 40, 50, 60, 70, 80] and plan.total == 90
    # The remainder (30 = 3 x 8 + 6) ends the last stretch: targets 79-92, scored by a
    # whole window and the head of the next.
    plan = window_plan(100, 8, "nonoverlapping", tokens=30, stride=None)
    assert plan.starts.tolist() == [0, 39, 78, 86] and plan.scored.tolist() == [8, 8, 8, 6]
    # Stretches are whole windows of the longest length, and a shorter length tiles them.
    plan = window_plan(100, 5, "nonoverlapping", tokens=30, stride=None, longest=10)
    assert plan.starts.tolist() == [0, 5, 40, 45, 80, 85] and plan.total == 30


def test_scored_stretches_cover_the_whole_validation_split() -> None:
    blocks = scored_blocks(1_000_000, 1024, 65_536, first=1)
    assert len(blocks) == MAX_BLOCKS and {size for _, size in blocks} == {1024}
    assert blocks[0][0] == 1 and blocks[-1][0] + 1024 - 1 == 1_000_000 - 1024
    starts = [target for target, _ in blocks]
    assert all(b - a >= 1024 for a, b in itertools.pairwise(starts))  # disjoint
    gaps = np.diff(starts)
    assert gaps.max() - gaps.min() <= 1  # evenly spread
    # Fewer targets than the longest window: one stretch at the start.
    assert scored_blocks(1000, 100, 40, first=1) == [(1, 40)]


@pytest.mark.parametrize("protocol", ["nonoverlapping", "sliding"])
def test_every_plan_stays_inside_the_stream_and_scores_each_target_once(protocol: str) -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        lengths = sorted({int(n) for n in rng.integers(2, 200, size=3)})
        valid = int(rng.integers(lengths[-1] + 1, 5000))
        tokens = int(rng.integers(1, 3000))
        stride = int(rng.integers(1, lengths[0] + 1)) if protocol == "sliding" else None
        seen = None
        for length in lengths:
            plan = window_plan(valid, length, protocol, tokens, stride, longest=lengths[-1])
            assert plan.starts.min() >= 0 and plan.starts.max() + length <= valid - 1
            targets = np.concatenate(
                [
                    start + 1 + plan.first_scored + np.arange(count)
                    for start, count in zip(plan.starts, plan.scored, strict=True)
                ]
            )
            assert len(np.unique(targets)) == len(targets) == min(tokens, valid - lengths[-1])
            assert seen is None or np.array_equal(np.sort(targets), seen)
            seen = np.sort(targets)


def test_training_windows_reach_the_last_byte_and_never_pass_it(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 3)
    task = build_task("lm", corpus=f"text:{text}")
    task.prepare(tmp_path / "cache", rooted(tmp_path))
    train = np.asarray(task.data.train)
    length = len(train) - 2  # windows of length + 1 bytes start at 0 or 1
    generator = torch.Generator().manual_seed(0)
    last = {int(task.train_batch(8, length, generator).targets[i, -1]) for i in range(8)}
    assert last == {int(train[-2]), int(train[-1])}


def test_sliding_windows_by_hand() -> None:
    plan = window_plan(100, 10, "sliding", tokens=12, stride=4)
    assert plan.starts.tolist() == [0, 4, 8] and plan.first_scored == 6 and plan.total == 12
    # In a study evaluated up to 20 bytes, the windows of 10 shift so that they score
    # the targets the windows of 20 score: 17..28.
    plan = window_plan(100, 10, "sliding", tokens=12, stride=4, longest=20)
    assert plan.starts.tolist() == [10, 14, 18]
    with pytest.raises(ValueError, match="stride"):
        window_plan(100, 10, "sliding", tokens=12, stride=11)
    with pytest.raises(CorpusError, match="has 5 bytes; evaluating at length 10 needs at least 11"):
        window_plan(5, 10, "nonoverlapping", tokens=12, stride=None)
    # The longest length decides for every length.
    with pytest.raises(CorpusError, match="evaluating at length 200 needs at least 201"):
        window_plan(100, 10, "nonoverlapping", tokens=12, stride=None, longest=200)


def _lm_task(tmp_path: Path):
    stream = bytes(range(32, 127)) * 40
    path = tmp_path / "stream.txt"
    path.write_bytes(stream)
    task = build_task("lm", corpus=f"text:{path}")
    task.prepare(tmp_path / "cache", rooted(tmp_path))
    return task


def test_sliding_scores_each_byte_once_with_at_least_length_minus_stride_context(
    tmp_path: Path,
) -> None:
    task = _lm_task(tmp_path)
    valid = np.asarray(task.data.valid)
    batches = list(
        task.eval_batches(16, protocol="sliding", batch_size=3, tokens=40, examples=0, stride=4)
    )
    scored_targets = torch.cat([b.targets[b.scored] for b in batches]).tolist()
    # Two stretches of 16 + 24 targets, the first at 16 - 4 + 1 = 13; a window scores
    # the last 4 of its 16 targets, each once.
    blocks = scored_blocks(len(valid), 16, 40, first=13)
    assert [size for _, size in blocks] == [16, 24] and blocks[0][0] == 13
    assert scored_targets == _stretches(valid, blocks)
    for batch in batches:
        assert batch.scored[:, :12].sum() == 0 and bool(batch.scored[:, 12:].all())
        assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def _scored_targets(batches) -> list[int]:
    return torch.cat(
        [b.targets.flatten() if b.scored is None else b.targets[b.scored] for b in batches]
    ).tolist()


def _stretches(valid: np.ndarray, blocks: list[tuple[int, int]]) -> list[int]:
    return np.concatenate([valid[target : target + size] for target, size in blocks]).tolist()


def test_nonoverlapping_scores_the_same_targets_at_every_length(tmp_path: Path) -> None:
    task = _lm_task(tmp_path)
    valid = np.asarray(task.data.valid)
    expected = _stretches(valid, scored_blocks(len(valid), 32, 64, first=1))
    assert len(expected) == 64
    for length in (8, 16, 24, 32):  # 24 does not divide 32
        batches = task.eval_batches(
            length, protocol="nonoverlapping", batch_size=2, tokens=64, examples=0, longest=32
        )
        assert _scored_targets(batches) == expected, length


def test_sliding_scores_the_same_targets_at_every_length(tmp_path: Path) -> None:
    task = _lm_task(tmp_path)
    valid = np.asarray(task.data.valid)
    # From 32 - 4 + 1 = 29 on, where the longest window first fits.
    blocks = scored_blocks(len(valid), 32, 40, first=29)
    assert blocks[0][0] == 29
    expected = _stretches(valid, blocks)
    for length in (8, 16, 32):
        batches = task.eval_batches(
            length,
            protocol="sliding",
            batch_size=3,
            tokens=40,
            examples=0,
            stride=4,
            longest=32,
        )
        assert _scored_targets(batches) == expected, length


def test_log_position_bins() -> None:
    assert log_bins(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    assert log_bins(16) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16)]
    accumulator = _Accumulator(8)
    targets = torch.zeros(2, 8, dtype=torch.long)
    logits = torch.zeros(2, 8, 4)
    logits[:, :4, 0] = 10.0  # confident and right on the first half, uniform after
    from worker.data.base import Batch

    accumulator.add(logits, Batch(targets, targets, None))
    bins = accumulator.bins()
    assert [(b.start, b.end, b.tokens) for b in bins] == [
        (0, 1, 2),
        (1, 2, 2),
        (2, 4, 4),
        (4, 8, 8),
    ]
    assert bins[0].loss < 1e-3 and bins[3].loss == pytest.approx(np.log(4), rel=1e-5)


def test_token_accuracy_gives_partial_credit_exact_match_does_not() -> None:
    from worker.data.base import Batch

    accumulator = _Accumulator(6)
    targets = torch.tensor([[1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 2, 3]])
    scored = torch.zeros(2, 6, dtype=torch.bool)
    scored[:, 3:] = True  # a 3-byte answer per example
    logits = torch.full((2, 6, 4), -10.0)
    logits[0].scatter_(1, targets[0, :, None], 10.0)  # example 0: every byte right
    logits[1, :, 0] = 10.0  # example 1: predicts byte 0 everywhere...
    logits[1, 3, 0], logits[1, 3, 1] = -10.0, 10.0  # ...but the first answer byte right
    accumulator.add(logits, Batch(targets, targets, scored))
    assert (accumulator.exact, accumulator.examples) == (1, 2)  # exact match: 1 of 2
    assert accumulator.right_tokens == 4 and accumulator.tokens == 6  # tokens: 4 of 6


# -- synthetic tasks ----------------------------------------------------------------------


def test_passkey_examples_by_depth() -> None:
    task = build_task("passkey")
    batches = list(
        task.eval_batches(256, protocol="nonoverlapping", batch_size=50, tokens=0, examples=20)
    )
    rows = [
        (decode(torch.cat([b.inputs[i, :1], b.targets[i]])), b.scored[i], b.groups[i])
        for b in batches
        for i in range(len(b.inputs))
    ]
    assert len(rows) == 20
    assert sorted({g for _, _, g in rows}) == sorted(f"depth={d:g}" for d in PASSKEY_DEPTHS)
    for text, scored, group in rows:
        assert len(text) == 257
        key = re.search(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\. ", text)
        assert key is not None
        assert text.endswith(QUESTION + key.group(1))
        assert scored.sum() == 5 and bool(scored[-5:].all())
        if group == "depth=0":
            assert text.startswith("The pass key is")
        if group == "depth=1":
            assert text[key.end() :].startswith(QUESTION)


def test_copy_and_assoc_recall_examples() -> None:
    generator = torch.Generator().manual_seed(0)
    copy_batch = build_task("copy", alphabet=4).train_batch(3, 21, generator)
    for i in range(3):
        text = decode(torch.cat([copy_batch.inputs[i, :1], copy_batch.targets[i]]))
        source, copied = text.strip().split("|")
        assert source == copied and len(source) == 10 and set(source) <= set("abcd")
        assert copy_batch.scored[i].sum() == 10
    recall = build_task("assoc_recall").train_batch(4, 100, generator)
    for i in range(4):
        text = decode(torch.cat([recall.inputs[i, :1], recall.targets[i]])).strip()
        body, query = text.split("?")
        pairs = dict(p.split("=") for p in body.strip(";").split(";"))
        assert len(pairs) == body.count(";")  # distinct keys
        key, value = query.split("=")
        assert pairs[key] == value and recall.scored[i].sum() == 2


def test_evaluation_examples_are_the_same_for_every_run() -> None:
    task = build_task("assoc_recall")
    first = next(
        task.eval_batches(64, protocol="nonoverlapping", batch_size=8, tokens=0, examples=8)
    )
    second = next(
        task.eval_batches(64, protocol="nonoverlapping", batch_size=8, tokens=0, examples=8)
    )
    assert torch.equal(first.inputs, second.inputs)


def test_exact_match_scorer() -> None:
    from worker.data.base import Batch

    targets = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    scored = torch.tensor([[False, False, True, True]] * 3)
    logits = torch.nn.functional.one_hot(targets, 8).float()
    logits[1, 3] = torch.nn.functional.one_hot(torch.tensor(0), 8).float()  # wrong in the answer
    logits[2, 0] = torch.nn.functional.one_hot(torch.tensor(0), 8).float()  # wrong, unscored
    accumulator = _Accumulator(4)
    accumulator.add(logits, Batch(targets, targets, scored, ["a", "a", "b"]))
    assert accumulator.exact == 2 and accumulator.examples == 3
    assert accumulator.group_exact == {"a": [1, 2], "b": [1, 1]}
    assert accumulator.tokens == 6


def test_assoc_recall_draws_distinct_keys_from_a_huge_key_space() -> None:
    # 26^6 keys: no permutation of them all is built (it would take gigabytes).
    task = build_task("assoc_recall", key_length=6)
    text, _, _ = task.example(2048, torch.Generator().manual_seed(0), None)
    body = text.decode().strip().split("?")[0]
    keys = [pair.split("=")[0] for pair in body.split(";") if pair]
    assert len(keys) == (2048 + 1 - 10) // 10 and len(set(keys)) == len(keys)


def test_the_evaluation_plan_is_checked_before_training(tmp_path: Path) -> None:
    from core.spec import parse_spec
    from worker.run import prepared_task

    small = tmp_path / "small.txt"
    small.write_text("x" * 3000)
    spec = parse_spec(
        {
            "model": "tiny",
            "task": {"name": "lm", "corpus": f"text:{small}"},
            "train": {"length": 16},
            "encodings": ["nope"],
            "eval": {"lengths": [16, 4096]},
        }
    )
    with pytest.raises(CorpusError, match="evaluating at length 4096 needs at least 4097"):
        prepared_task(spec, tmp_path / "cache", rooted(tmp_path))
