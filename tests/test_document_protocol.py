"""The ``document`` protocol (issue 21): each document long enough for the longest length,
truncated to the evaluated length and scored from its start, never across a boundary
(the yarn repo's and the PI paper's protocol)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_models import CONTEXT, TEXT, build_tokenizer, save_model

from core.catalog.hf_models import ModelPolicy
from core.spec import EvalSpec, SpecError, VariantSpec, parse_spec
from worker.data.lm import DOC_SEPARATOR, Corpus, LanguageModelling, document_spans
from worker.data.sources import CorpusError
from worker.evaluate import evaluate_length
from worker.hf.loader import load_model
from worker.hf.tokens import tokenized
from worker.model import build_model

CPU = torch.device("cpu")
NONE = VariantSpec()


def toy_documents(sizes: tuple[int, ...] = (100, 600, 900), seed: int = 7) -> list[bytes]:
    """Documents of printable bytes (never the separator), each different."""
    generator = np.random.default_rng(seed)
    return [bytes(generator.integers(32, 127, size, dtype=np.uint8)) for size in sizes]


def toy_task(documents: list[bytes]) -> LanguageModelling:
    task = LanguageModelling("text:toy")
    stream = np.frombuffer(DOC_SEPARATOR.join(documents), dtype=np.uint8)
    task.corpus = Corpus("text:toy", "toy", stream, stream)
    return task


def row_at(model, task, spec: EvalSpec, length: int, protocol: str = "document"):
    return evaluate_length(
        model,
        task,
        spec,
        length=length,
        protocol=protocol,
        variant=NONE,
        train_length=64,
        device=CPU,
    )


def test_documents_are_split_at_the_separator() -> None:
    stream = np.frombuffer(b"ab\x00cde\x00\x00f", dtype=np.uint8)
    assert document_spans(stream, 0).tolist() == [[0, 2], [3, 6], [7, 7], [8, 9]]


def test_scores_exactly_the_first_bytes_of_each_long_enough_document() -> None:
    documents = toy_documents()
    task = toy_task(documents)
    batches = list(
        task.eval_batches(
            512, protocol="document", batch_size=8, tokens=1 << 16, examples=1, longest=512
        )
    )
    assert len(batches) == 1 and batches[0].scored is None
    inputs, targets = batches[0].inputs, batches[0].targets
    # Documents 2 and 3 (600 and 900 bytes); the 100-byte one is too short for 512.
    assert [bytes(row.tolist()) for row in targets] == [documents[1][:512], documents[2][:512]]
    # Each window starts with the separator the model trained on before a document.
    assert inputs[:, 0].tolist() == [DOC_SEPARATOR[0]] * 2
    assert [bytes(row[1:].tolist()) for row in inputs] == [documents[1][:511], documents[2][:511]]


def test_the_loss_equals_a_hand_loop_over_documents() -> None:
    documents = toy_documents()
    task = toy_task(documents)
    model = build_model("tiny", "alibi", train_length=64, seed=3).eval()
    spec = EvalSpec(lengths=[256, 512], protocols=["document"], tokens=1 << 16)
    row = row_at(model, task, spec, 512)
    losses = []
    with torch.no_grad():
        for document in documents[1:]:
            window = torch.tensor([DOC_SEPARATOR[0], *document[:512]])[None]
            logits = model(window[:, :-1])
            losses.append(float(F.cross_entropy(logits[0].float(), window[0, 1:])))
    assert row.loss == pytest.approx(sum(losses) / len(losses), abs=1e-6)
    assert row.tokens == 2 * 512
    # The same documents at a shorter length: their first 256 bytes.
    shorter = row_at(model, task, spec, 256)
    assert shorter.tokens == 2 * 256


def test_min_document_bytes_keeps_only_longer_documents() -> None:
    documents = toy_documents()
    task = toy_task(documents)
    batches = task.eval_batches(
        256,
        protocol="document",
        batch_size=8,
        tokens=1 << 16,
        examples=1,
        longest=512,
        min_document_bytes=700,
    )
    assert [bytes(b.tolist()) for batch in batches for b in batch.targets] == [documents[2][:256]]
    with pytest.raises(CorpusError, match="documents of at least 1024 tokens"):
        task.check_plan(EvalSpec(lengths=[1024], protocols=["document"]))
    with pytest.raises(CorpusError, match="and 1000 bytes"):
        task.check_plan(EvalSpec(lengths=[512], protocols=["document"], min_document_bytes=1000))


def test_the_budget_picks_documents_spread_over_the_split() -> None:
    documents = toy_documents((300,) * 12, seed=1)
    task = toy_task(documents)
    batches = task.eval_batches(
        128, protocol="document", batch_size=64, tokens=4 * 256, examples=1, longest=256
    )
    picked = [bytes(b.tolist()) for batch in batches for b in batch.targets]
    # tokens // longest = 4 documents, evenly spread: 0, 3, 6 and 9.
    assert picked == [documents[k][:128] for k in (0, 3, 6, 9)]


SPEC = {
    "model": "tiny",
    "train": {"length": 64, "steps": 2, "batch_size": 2},
    "encodings": ["rope"],
    "eval": {"lengths": [64, 128], "protocols": ["nonoverlapping", "document"]},
}


def test_the_spec_names_what_is_wrong_with_a_document_evaluation() -> None:
    parse_spec(SPEC)
    with pytest.raises(SpecError, match="'document' applies to language modelling, not 'passkey'"):
        parse_spec({**SPEC, "task": "passkey", "train": {**SPEC["train"], "length": 128}})
    with pytest.raises(SpecError, match="min_document_bytes applies to the 'document' protocol"):
        parse_spec({**SPEC, "eval": {"lengths": [64], "min_document_bytes": 100}})
    with pytest.raises(SpecError, match=r"eval\.bos applies to hf: models"):
        parse_spec({**SPEC, "eval": {**SPEC["eval"], "bos": True}})


def test_earlier_studies_keep_their_hashes() -> None:
    plain = parse_spec({**SPEC, "eval": {"lengths": [64, 128]}})
    spelled = parse_spec(
        {**SPEC, "eval": {"lengths": [64, 128], "protocols": ["nonoverlapping"], "bos": False}}
    )
    encoding = plain.encodings[0]
    assert plain.config_hash(encoding, 0) == spelled.config_hash(encoding, 0)
    document = parse_spec(SPEC)
    assert document.config_hash(encoding, 0) != plain.config_hash(encoding, 0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("models")
    save_model(root / "llama", "llama")
    return load_model("llama", ModelPolicy(roots=(root.resolve(),)))


def hf_documents() -> list[str]:
    words = TEXT.split()
    generator = np.random.default_rng(5)
    return [
        " ".join(generator.choice(words, size).tolist()) for size in (4, 40, 60)
    ]  # the first too short for a window of CONTEXT tokens


@pytest.mark.parametrize("bos", [False, True])
def test_an_hf_model_scores_each_document_from_its_start(llama, bos: bool) -> None:
    tokenizer = llama.tokenizer
    if bos and tokenizer.bos_token_id is None:
        tokenizer.bos_token = tokenizer.eos_token  # a model whose BOS is its end of text
    documents = hf_documents()
    task = LanguageModelling("text:toy")
    stream = np.frombuffer(DOC_SEPARATOR.join(d.encode() for d in documents), dtype=np.uint8)
    task.corpus = Corpus("text:toy", "toy", stream, stream)
    text = tokenized(task, tokenizer, bos=bos)
    length = CONTEXT - 1
    spec = EvalSpec(lengths=[length], protocols=["document"], tokens=1 << 16, bos=bos)
    row = evaluate_length(
        llama.model,
        text,
        spec,
        length=length,
        protocol="document",
        variant=NONE,
        train_length=CONTEXT,
        device=CPU,
    )
    nats = []
    with torch.no_grad():
        for document in documents[1:]:
            ids = tokenizer.backend_tokenizer.encode(document, add_special_tokens=False).ids
            window = [tokenizer.bos_token_id, *ids[:length]] if bos else ids[: length + 1]
            input_ids = torch.tensor(window)[None]
            nats.append(float(llama.model.hf(input_ids=input_ids, labels=input_ids).loss))
    assert row.tokens == 2 * length
    assert row.loss == pytest.approx(sum(nats) / 2, abs=1e-5)
    assert math.isfinite(row.bits_per_byte)


def test_bos_is_refused_for_a_tokenizer_without_one(llama) -> None:
    tokenizer = build_tokenizer()
    tokenizer.bos_token = None
    assert tokenizer.bos_token_id is None
    task = toy_task([b"x" * 50])
    with pytest.raises(CorpusError, match="no beginning-of-sequence token"):
        tokenized(task, tokenizer, bos=True)
