"""Tiny HuggingFace models for the tests, made here and never downloaded: GPT-2 (learned
absolute positions), GPT-NeoX (RoPE on a quarter of each head, as Pythia) and Llama
(RoPE), random weights from a fixed seed, saved with ``save_pretrained`` into a folder
with a byte-level BPE tokenizer trained on a few sentences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Text the tokenizer learns its merges from, and a corpus to evaluate on.
TEXT = (
    "The quick brown fox jumps over the lazy dog. A position encoding tells a "
    "transformer where each token sits; past the training length some keep working "
    "and others fall apart. def f(x):\n    return x + 1\n"
    "Ünïcödé bytes and an emoji 😀 take several bytes each. "
)
FAMILIES = ("gpt2", "gpt_neox", "llama")
MORE_ROPE = ("mistral", "qwen2")  # the other RoPE families, HF's Llama code path
# The 2025-26 families: 6 layers, so that each one's pattern of layers shows, and a
# sliding window (or chunk) of 8 tokens, shorter than the lengths evaluated.
NEW_FAMILIES = (
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "cohere2",
    "olmo2",
    "smollm3",
    "llama4_text",
)
WINDOW = 8
CONTEXT = 32  # n_positions / max_position_embeddings of every tiny model
VOCAB = 320
SEED = 1234


def build_tokenizer():
    """A byte-level BPE tokenizer of VOCAB entries with one special token, end of text
    (the benchmark's builder, trained on TEXT)."""
    from benchmarks.hf_build import build_tokenizer as trained_on

    return trained_on([TEXT] * 4, VOCAB)


def model_config(family: str, vocab_size: int, eos: int, context: int = CONTEXT, **extra: Any):
    """The config of a tiny model of ``family``: 2 layers, 2 heads of 16 dimensions, an
    original context of ``context`` positions."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

    ids = {"bos_token_id": eos, "eos_token_id": eos, "vocab_size": vocab_size}
    if family == "gpt2":
        return GPT2Config(n_positions=context, n_embd=32, n_layer=2, n_head=2, **ids, **extra)
    sizes = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": context,
    }
    if family == "gpt_neox":
        return GPTNeoXConfig(rotary_pct=0.25, **sizes, **ids, **extra)
    if family == "llama":
        return LlamaConfig(num_key_value_heads=1, **sizes, **ids, **extra)
    if family == "mistral":
        return MistralConfig(num_key_value_heads=1, sliding_window=None, **sizes, **ids, **extra)
    if family == "qwen2":
        return Qwen2Config(num_key_value_heads=1, rope_theta=1e4, **sizes, **ids, **extra)
    return new_family_config(family, sizes, ids, **extra)


def new_family_config(family: str, sizes: dict[str, int], ids: dict[str, int], **extra: Any):
    """A tiny config of one of NEW_FAMILIES (transformers' own classes, as its tests make
    them): 6 layers, 2 heads of 16, one key-value head, a window of WINDOW tokens."""
    import transformers

    sizes = {**sizes, "num_hidden_layers": 6, "num_key_value_heads": 1}
    ids = {**ids, "pad_token_id": ids["eos_token_id"]}
    window = {"sliding_window": WINDOW}
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    made = {
        "qwen3": ("Qwen3Config", {"head_dim": 16, **rope}),
        "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, **window}),
        "gemma3_text": (
            "Gemma3TextConfig",
            {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window_pattern": 3, **window},
        ),
        "phi3": ("Phi3Config", rope),
        "cohere2": ("Cohere2Config", {**window, **rope}),
        "olmo2": ("Olmo2Config", rope),
        "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 3, **rope}),
        "llama4_text": (
            "Llama4TextConfig",
            {
                "head_dim": 16,
                "attention_chunk_size": WINDOW,
                "floor_scale": WINDOW,
                "intermediate_size_mlp": 64,
                "num_local_experts": 1,
                "no_rope_layer_interval": 3,
                **rope,
            },
        ),
    }
    if family not in made:
        raise ValueError(family)
    name, own = made[family]
    return getattr(transformers, name)(**sizes, **ids, **own, **extra)


def save_model(folder: Path, family: str, seed: int = SEED, context: int = CONTEXT) -> Path:
    """A tiny ``family`` model with random weights from ``seed`` and the tokenizer, saved
    into ``folder`` (config.json, model.safetensors, tokenizer files)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = model_config(family, len(tokenizer), tokenizer.eos_token_id, context)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def corpus_text(repeats: int = 6) -> str:
    """A validation text for the tiny models: TEXT, shuffled a little each time."""
    words = TEXT.split(" ")
    lines = []
    for k in range(repeats):
        lines.append(" ".join(words[k % len(words) :] + words[: k % len(words)]))
    return "\n".join(lines)


# The tasks whose text the tokenizers are trained on: a fixed list, so that a task added
# to the catalogue does not change every tokenizer's merges (and the tests' token counts).
TOKENIZER_TASKS = (
    "passkey",
    "copy",
    "assoc_recall",
    "sov_tr",
    "niah",
    "variable_tracking",
    "common_words",
    "frequent_words",
)


def task_text() -> list[str]:
    """Text like the synthetic tasks' (each task's examples at a fixed seed) and TEXT, for
    tokenizers with merges that span their words, as a real model's tokenizer has."""
    from worker.data import build_task

    texts = [TEXT]
    for name in TOKENIZER_TASKS:
        task = build_task(name)
        generator = torch.Generator().manual_seed(SEED)
        texts += [task.example(600, generator, None)[0].decode() for _ in range(4)]
    return texts


def family_tokenizer(family: str):
    """A tokenizer trained here in the manner of ``family``'s, on task_text():

    - gpt2: byte-level BPE (GPT-2's pre-tokenizer), offsets trimmed of the space a word
      token starts with;
    - gpt_neox: byte-level BPE as Pythia's, offsets that keep that space;
    - llama: SentencePiece-style BPE (Llama 2): ``▁`` for spaces and one before the
      text, digits one by one, bytes of an unknown character as <0xNN> tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if family == "llama":
        bytes_ = [f"<0x{i:02X}>" for i in range(256)]
        backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"),
                pre_tokenizers.Digits(individual_digits=True),
            ]
        )
        backend.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=900, special_tokens=["<unk>", "<s>", "</s>", *bytes_], show_progress=False
        )
        backend.train_from_iterator(task_text(), trainer)
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
    trim = family == "gpt2"
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=trim)
    backend.post_processor = processors.ByteLevel(trim_offsets=trim)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700 if trim else 800,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(task_text(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
