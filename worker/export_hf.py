"""A trained posbench model as a Hugging Face transformers folder: a GPT-NeoX model that
``AutoModelForCausalLM.from_pretrained`` loads, with a byte tokenizer.

GPT-NeoX's block is posbench's block (``worker/layers.py``, stacked in ``worker/model.py``)
once a few things are stated its way:

- pre-norm LayerNorm (eps 1e-5) in sequence: ``use_parallel_residual`` false;
- posbench's LayerNorms and linear layers have no bias: GPT-NeoX's attention takes
  ``attention_bias`` false, its LayerNorms and MLP have biases, written as zeros;
- the MLP is exact GELU (``hidden_act`` ``gelu``) at 4 x the width;
- q, k and v come from one projection: posbench's rows are (q | k | v) by head,
  GPT-NeoX's are by head, (q | k | v) within each, so the rows are reordered;
- RoPE rotates halves (dimension j with j + r/2) over the first r dimensions of each
  head in both, at ``partial_rotary_factor`` r / head_dim; 0 rotates nothing (NoPE);
- posbench ties the output layer to the token embedding and multiplies the embedding
  by sqrt(d_model) on the way in; GPT-NeoX's two are untied: ``embed_in`` is the
  embedding times sqrt(d_model), ``embed_out`` the embedding itself.

Tokens are bytes: id = the byte's value, 256 of them. Byte 0 (NUL, the separator
posbench puts between documents) is the tokenizer's bos, eos and pad token.

``write_hf_folder`` writes the folder next to ``out``, loads it back with transformers,
checks that its logits equal posbench's past the training length, and only then puts
it in place: a folder that does not compute what posbench measured is never written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from core.catalog.scalings import ORIGINAL, Rotary, scaling_info
from core.errors import UserError
from core.files import write_atomic
from worker.data.lm import DOC_SEPARATOR
from worker.model import Transformer

ARCHITECTURE = "GPTNeoXForCausalLM"
# What an export folder holds: --force replaces a folder holding these files only.
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
)
# The exported model's logits may differ from posbench's by this much, times the
# largest logit (at least 1), before the export is refused: float32 sums in another
# order differ by about 1e-6; a wrong mapping, by whole units.
CHECK_TOLERANCE = 1e-4
CHECK_SEED = 0


class ExportRefused(UserError, ValueError):
    """What keeps a model from being exported where asked (the caller's input)."""


class ExportMismatch(RuntimeError):
    """The written folder does not compute what the posbench model computes."""


@dataclass(frozen=True)
class HfScaling:
    """A RoPE scaling written into the export's config: a catalogue scaling, its factor
    (None for one that takes none) and its parameters."""

    method: str
    factor: float | None = None
    params: Mapping[str, Any] = field(default_factory=dict)


# -- the weights ---------------------------------------------------------------------------


def neox_weights(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under GPT-NeoX's names and layout, float32 on the CPU."""
    cfg = model.config
    d, heads, head_dim = cfg.d_model, cfg.n_heads, cfg.head_dim
    state = {
        name: value.detach().to("cpu", torch.float32) for name, value in model.state_dict().items()
    }
    used: set[str] = set()

    def take(name: str) -> Tensor:
        used.add(name)
        return state[name]

    embedding = take("token_embedding.weight")
    out = {
        "gpt_neox.embed_in.weight": embedding * math.sqrt(d),
        "embed_out.weight": embedding.clone(),
        "gpt_neox.final_layer_norm.weight": take("final_norm.weight").clone(),
        "gpt_neox.final_layer_norm.bias": torch.zeros(d),
    }
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        qkv = take(ours + "attn.qkv.weight").view(3, heads, head_dim, d)
        up = take(ours + "mlp.up.weight")
        out |= {
            theirs + "input_layernorm.weight": take(ours + "attn_norm.weight").clone(),
            theirs + "input_layernorm.bias": torch.zeros(d),
            theirs + "post_attention_layernorm.weight": take(ours + "mlp_norm.weight").clone(),
            theirs + "post_attention_layernorm.bias": torch.zeros(d),
            theirs + "attention.query_key_value.weight": qkv.transpose(0, 1).reshape(3 * d, d),
            theirs + "attention.dense.weight": take(ours + "attn.proj.weight").clone(),
            theirs + "mlp.dense_h_to_4h.weight": up.clone(),
            theirs + "mlp.dense_h_to_4h.bias": torch.zeros(up.shape[0]),
            theirs + "mlp.dense_4h_to_h.weight": take(ours + "mlp.down.weight").clone(),
            theirs + "mlp.dense_4h_to_h.bias": torch.zeros(d),
        }
    left = sorted(set(state) - used)
    if left:  # an encoding with weights of its own: GPT-NeoX has nowhere to put them
        raise ExportRefused(
            f"encoding {model.encoding.name!r} has weights of its own ({', '.join(left)}), "
            "which a GPT-NeoX model has no place for"
        )
    return {name: value.contiguous() for name, value in out.items()}


# -- the config ----------------------------------------------------------------------------


def rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """GPT-NeoX's ``partial_rotary_factor`` for ``rotary_dim`` of ``head_dim``: transformers
    rotates int(head_dim x factor) dimensions, which must come out as ``rotary_dim``."""
    factor = rotary_dim / head_dim
    while int(head_dim * factor) < rotary_dim:
        factor = math.nextafter(factor, 1.0)
    return factor


def rope_parameters(rotary: Rotary, head_dim: int, scaling: HfScaling | None) -> dict[str, Any]:
    """transformers' ``rope_parameters``: plain RoPE, or the scaling the catalogue states
    in transformers' words, with the fraction of each head that rotates."""
    if scaling is None:
        parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rotary.base}
    else:
        if rotary.rotary_dim == 0:
            raise ExportRefused(
                "a RoPE scaling needs a model that rotates; this one rotates nothing"
            )
        entry = scaling_info(scaling.method)
        parameters = entry.hf_rope_parameters(scaling.factor, scaling.params, rotary)
    return {**parameters, "partial_rotary_factor": rotary_factor(rotary.rotary_dim, head_dim)}


def neox_config(model: Transformer, rotary: Rotary, scaling: HfScaling | None) -> dict[str, Any]:
    """config.json: GPT-NeoX with posbench's dimensions and rotary part. Its
    ``max_position_embeddings`` is the training length (transformers' dynamic scaling
    measures lengths from it), or for a scaling that states its original length, the
    factor times that length (transformers' convention); nothing in GPT-NeoX stops a
    longer sequence."""
    from transformers import GPTNeoXConfig

    cfg = model.config
    rope = rope_parameters(rotary, cfg.head_dim, scaling)
    original = rope.get(ORIGINAL)
    longest = rotary.original_length
    if original is not None:
        longest = math.ceil(rope.get("factor", 1.0) * original)
    separator = DOC_SEPARATOR[0]
    config = GPTNeoXConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.mlp_ratio * cfg.d_model,
        hidden_act="gelu",
        max_position_embeddings=longest,
        layer_norm_eps=model.final_norm.eps,
        use_parallel_residual=False,
        attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters=rope,
        bos_token_id=separator,
        eos_token_id=separator,
        pad_token_id=separator,
        architectures=[ARCHITECTURE],
        dtype="float32",
    )
    data = config.to_dict()
    # transformers 4 (and vLLM on it) reads the rotary part under its older names; 5 reads
    # rope_scaling as the whole of rope_parameters, so it is written whole.
    data |= {"rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": rope["rope_theta"]}
    if scaling is not None:
        data["rope_scaling"] = dict(rope)
    return data


# -- the tokenizer -------------------------------------------------------------------------


def byte_characters() -> list[str]:
    """The character that tokenizers' ByteLevel pre-tokenizer (GPT-2's) writes for each
    byte: the byte's own where it is printable (33-126, 161-172, 174-255), else
    256 + n for the n-th byte that is not, in byte order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_tokenizer() -> dict[str, bytes]:
    """tokenizer.json and its configuration: every byte its own token, id = its value
    (a BPE model without merges behind the ByteLevel pre-tokenizer), no token added
    around a text. NUL is bos, eos and pad; ``split_special_tokens`` keeps the
    character that names it (U+0100) in a text two bytes, as posbench reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    characters = byte_characters()
    tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(characters)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    separator = characters[DOC_SEPARATOR[0]]
    special = {"bos_token": separator, "eos_token": separator, "pad_token": separator}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "split_special_tokens": True,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True).encode(),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(special),
    }


def _json(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()


# -- the folder ----------------------------------------------------------------------------


def out_problem(out: Path, force: bool) -> str | None:
    """Why ``out`` cannot receive an export (None when it can): a link, a file, or a folder
    with something in it; with ``force``, a folder holding an earlier export's files and
    nothing else is replaced."""
    if out.is_symlink():
        return (
            f"--out {out} is a symbolic link; the export is written as a folder of its own, "
            "never through a link (give the folder itself, or another)"
        )
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a folder (created if missing)"
    entries = sorted(path.name for path in out.iterdir()) if out.exists() else []
    if not entries:
        return None
    if not force:
        return (
            f"--out {out} is not empty ({', '.join(entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}); give a new or empty folder, or --force "
            "to replace an earlier export there"
        )
    others = [n for n in entries if n not in FILES or not _plain_file(out / n)]
    if others:
        return (
            f"--out {out} holds {others[0]!r}, which an export does not write; --force "
            "replaces an earlier export and nothing else: give another folder"
        )
    return None


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def check_logits(model: Transformer, folder: Path, scaling: HfScaling | None, length: int) -> float:
    """The largest difference between the logits of the folder's model (loaded by
    transformers) and posbench's, under ``scaling``, on ``length`` random bytes."""
    from transformers import GPTNeoXForCausalLM

    hf, loading = GPTNeoXForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    unmatched = [name for kind in ("missing_keys", "unexpected_keys") for name in loading[kind]]
    if unmatched:
        raise ExportMismatch(f"transformers did not load every weight: {', '.join(unmatched)}")
    generator = torch.Generator().manual_seed(CHECK_SEED)
    tokens = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)
    device = next(model.parameters()).device
    with torch.no_grad():
        if scaling is None:
            ours = model(tokens.to(device))
        else:
            with model.scaled(scaling.method, scaling.factor, **scaling.params) as scaled:
                ours = scaled(tokens.to(device))
        theirs = hf(tokens).logits
    ours = ours.float().cpu()
    difference = (ours - theirs).abs().max().item()
    if not difference <= CHECK_TOLERANCE * max(1.0, ours.abs().max().item()):
        raise ExportMismatch(
            f"the exported model's logits differ from posbench's by {difference:.3g} at "
            f"{length} tokens (transformers {_transformers_version()}); nothing was written"
        )
    return difference


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_length(rotary: Rotary) -> int:
    """The length the check runs at: past the training length, where scalings act."""
    return min(2 * rotary.original_length, rotary.original_length + 256)


def write_hf_folder(
    model: Transformer,
    out: Path,
    *,
    rotary: Rotary,
    scaling: HfScaling | None = None,
    card: str = "",
    force: bool = False,
) -> float:
    """Write ``model`` (its rotary part: ``rotary``, from the catalogue's ``hf_rotary``)
    as an HF transformers folder at ``out``, with ``scaling`` in its config and ``card``
    as its README.md. The folder is written beside ``out``, checked (``check_logits``)
    and renamed into place; returns the largest logit difference found."""
    from safetensors.torch import save

    problem = out_problem(out, force)
    if problem:
        raise ExportRefused(problem)
    contents = {
        "config.json": _json(neox_config(model, rotary, scaling)),
        "generation_config.json": _json(_generation_config()),
        **byte_tokenizer(),
        "README.md": card.encode(),
    }
    weights = save(neox_weights(model), metadata={"format": "pt"})
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    staging.mkdir()
    try:
        for name, content in {**contents, "model.safetensors": weights}.items():
            write_atomic(staging / name, content)
        difference = check_logits(model, staging, scaling, check_length(rotary))
        _put_in_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return difference


def _generation_config() -> dict[str, Any]:
    separator = DOC_SEPARATOR[0]
    return {"bos_token_id": separator, "eos_token_id": separator, "pad_token_id": separator}


def _put_in_place(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``; an ``out`` already there (empty, or an earlier
    export ``out_problem`` let through) is renamed aside first and removed after."""
    if not out.exists():
        os.replace(staging, out)
        return
    problem = out_problem(out, force=True)  # checked again: it may have changed since
    if problem:
        raise ExportRefused(problem)
    aside = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.old")
    os.replace(out, aside)
    os.replace(staging, out)
    shutil.rmtree(aside, ignore_errors=True)
