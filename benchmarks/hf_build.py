"""A Llama-style HuggingFace model with random weights and a byte-level BPE tokenizer,
built here and never downloaded, for ``benchmarks.hf_eval``: generated text (made-up
words drawn Zipf-like) to train the tokenizer on and to evaluate, the model saved with
``save_pretrained`` as a models root holds one, and the lm task over that text in the
model's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

NAME = "bench-llama"  # the model's folder inside the models root
SEED = 1234


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int  # max_position_embeddings: the model's original context
    vocab: int  # the output layer's width (the tokenizer may use fewer ids)


SIZES = {
    # Small enough for a test on two CPU cores.
    "tiny": Size(
        hidden=64, layers=2, heads=4, kv_heads=2, intermediate=172, context=128, vocab=512
    ),
    "small": Size(
        hidden=256, layers=4, heads=4, kv_heads=4, intermediate=688, context=256, vocab=4096
    ),
    # GPT-2 small / Pythia-160m's sizes in Llama's layout: 134M parameters.
    "150m": Size(
        hidden=768, layers=12, heads=12, kv_heads=12, intermediate=2048, context=1024, vocab=32000
    ),
}


def _words(rng: np.random.Generator, count: int) -> list[str]:
    """``count`` made-up words of 1 to 9 letters."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    weights = 1.0 / np.arange(1, len(letters) + 1)
    lengths = rng.integers(1, 10, size=count)
    return ["".join(rng.choice(letters, size=n, p=weights / weights.sum())) for n in lengths]


def generated_documents(words: int, seed: int = SEED, per_document: int = 2000) -> list[str]:
    """Text of ``words`` words drawn Zipf-like from a made-up lexicon, with punctuation
    and line breaks, in documents of ``per_document`` words: the evaluation corpus."""
    rng = np.random.default_rng(seed)
    lexicon = np.array(_words(rng, 4000))
    ranks = np.minimum(rng.zipf(1.2, size=words), len(lexicon)) - 1
    drawn = lexicon[ranks]
    ends = rng.choice(np.array(["", "", "", "", "", "", ",", ".", ".\n"]), size=words)
    tokens = [w + e for w, e in zip(drawn.tolist(), ends.tolist(), strict=True)]
    return [
        " ".join(tokens[start : start + per_document]) for start in range(0, words, per_document)
    ]


def build_tokenizer(documents: list[str], vocab: int):
    """A byte-level BPE tokenizer of at most ``vocab`` entries (end of text the first),
    trained on the first documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents[:20], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


def save_model(folder: Path, size: Size, documents: list[str], seed: int = SEED) -> Path:
    """A Llama model of ``size`` with random weights from ``seed`` (float32, tied
    embeddings off, as Llama) and a tokenizer trained on ``documents``, saved into
    ``folder``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = build_tokenizer(documents, size.vocab)
    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=size.context,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def text_task(documents: list[str], tokenizer: Any):
    """The lm task with ``documents`` as its validation split, in ``tokenizer``'s tokens
    (``worker.hf.tokens``, as a worker tokenizes a study's corpus)."""
    from worker.data.lm import DOC_SEPARATOR, Corpus, LanguageModelling
    from worker.hf.tokens import tokenized

    task = LanguageModelling("text:bench.txt")
    stream = np.frombuffer(DOC_SEPARATOR.join(d.encode() for d in documents), dtype=np.uint8)
    task.corpus = Corpus("text:bench.txt", "bench", stream, stream)
    return tokenized(task, tokenizer)
