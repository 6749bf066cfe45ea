"""The catalogue of position encodings (and, from :mod:`core.catalog.scalings`, the RoPE
inference-time scalings).

This module is deliberately free of torch: the CLI, the spec validation and the
dashboard read it on their hot path. Each entry names the class that implements
it as ``"module:Class"``; :func:`worker.encodings.build` imports it on demand.

Adding an encoding = its module under ``worker/encodings/`` + one entry below + its
reference test (docs/adding-an-encoding.md). An entry carries its own rules (``check``):
no other module names an encoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.catalog.encoding_entry import (
    ROPE_BASE,
    SHARED_PARAMS,
    WINDOW,
    EncodingInfo,
    Fit,
)
from core.catalog.params import EncodingConfigError, Param, short_repr
from core.catalog.scaling_entry import LOGN, TEMPERATURES, TemperatureInfo
from core.catalog.scalings import NO_SCALING, SCALINGS, ScalingInfo, scaling_info

__all__ = [
    "LOGN",
    "NO_SCALING",
    "REGISTRY",
    "SCALINGS",
    "SHARED_PARAMS",
    "TEMPERATURES",
    "WINDOW",
    "EncodingInfo",
    "Fit",
    "Param",
    "ScalingInfo",
    "TemperatureInfo",
    "hf_exportable",
    "info",
    "scaling_info",
]


def _t5_buckets(params: Mapping[str, Any], fit: Fit) -> list[str]:
    if params["max_distance"] > params["num_buckets"] // 2:
        return []
    return [
        f"max_distance={params['max_distance']} must exceed num_buckets / 2 = "
        f"{params['num_buckets'] // 2} (the exact buckets; log-spaced ones follow)"
    ]


def _proportional_scaling(params: Mapping[str, Any]) -> str | None:
    if params.get("proportional"):
        return "proportional RoPE takes no scaling yet (its still pairs have no frequency)"
    return None


def _layers_for(name: str, cycle: int, what: str, fit: Fit) -> list[str]:
    if fit.n_layers is None or fit.n_layers >= cycle:
        return []
    return [
        f"{name}={cycle - 1 if name == 'pattern' else cycle} needs at least {cycle} layers "
        f"({what}); this model has {fit.n_layers}"
    ]


def _local_global_fits(params: Mapping[str, Any], fit: Fit) -> list[str]:
    return _layers_for("pattern", params["pattern"] + 1, "the local ones, then a global", fit)


def _local_global_scaling(params: Mapping[str, Any]) -> str | None:
    if params["global"] == "nope":
        return (
            "the scalings apply to the global layers, as Gemma 3's rope_scaling does, and "
            "they are NoPE here (global: nope)"
        )
    return None


def _irope_fits(params: Mapping[str, Any], fit: Fit) -> list[str]:
    return _layers_for("every", params["every"], "the RoPE ones, then a NoPE layer", fit)


def _randomized_range(params: Mapping[str, Any], fit: Fit) -> list[str]:
    limit = params["max_position"] or 64 * fit.train_length
    if limit >= max(fit.train_length, fit.longest):
        return []
    return [
        f"max_position = {limit} must be at least the training length {fit.train_length} "
        f"and the longest evaluation length {fit.longest}"
    ]


_ROPE_BASE = Param("base", float, ROPE_BASE, "base of the geometric frequency ladder", low=2.0)
_ROTARY_FRACTION = Param(
    "rotary_fraction",
    float,
    1.0,
    "fraction of each head's dimensions that is rotated (GPT-NeoX uses 0.25)",
    choices=(0.25, 0.5, 1.0),
)

REGISTRY: dict[str, EncodingInfo] = {
    info.name: info
    for info in (
        EncodingInfo(
            name="nope",
            family="none",
            summary="No position signal at all; the causal mask alone breaks permutation symmetry.",
            reference="Kazemnejad et al. 2023, The Impact of Positional Encoding on Length "
            "Generalization in Transformers (arXiv:2305.19466)",
            implementation="worker.encodings.nope:NoPE",
            hf_export=True,
        ),
        EncodingInfo(
            name="sinusoidal",
            family="absolute",
            summary="Fixed sines and cosines of geometric frequencies, added to the token "
            "embedding.",
            reference="Vaswani et al. 2017, Attention Is All You Need (arXiv:1706.03762), §3.5",
            implementation="worker.encodings.sinusoidal:Sinusoidal",
            params=(Param("base", float, 10000.0, "wavelength base", low=2.0),),
        ),
        EncodingInfo(
            name="learned",
            family="absolute",
            summary="A trained table of one vector per position (GPT-2); undefined past the table.",
            reference="Radford et al. 2019, Language Models are Unsupervised Multitask Learners",
            implementation="worker.encodings.learned:Learned",
            bounded_by_train_length=True,
        ),
        EncodingInfo(
            name="rope",
            family="rotary",
            summary="Rotates query/key pairs by position-proportional angles; q·k depends on m-n.",
            reference="Su et al. 2021, RoFormer: Enhanced Transformer with Rotary Position "
            "Embedding (arXiv:2104.09864)",
            implementation="worker.encodings.rope:Rope",
            scaling_check=_proportional_scaling,
            params=(
                _ROPE_BASE,
                _ROTARY_FRACTION,
                Param(
                    "proportional",
                    bool,
                    False,
                    "transformers' proportional RoPE (Gemma 4's global layers): the ladder "
                    "spans the whole head, base^(-2j/head_dim), and only the fastest "
                    "rotary_fraction of the pairs turns; the others stand still",
                    optional=True,
                ),
            ),
            scalable=True,
            hf_export=True,
        ),
        EncodingInfo(
            name="xpos",
            family="rotary",
            summary="RoPE with a per-dimension exponential decay of q·k with distance.",
            reference="Sun et al. 2022, A Length-Extrapolatable Transformer (arXiv:2212.10554)",
            implementation="worker.encodings.xpos:XPos",
            params=(
                _ROPE_BASE,
                _ROTARY_FRACTION,
                Param(
                    "scale_base",
                    float,
                    512.0,
                    "distance over which the decay acts",
                    low=1.0,
                    high=1e6,
                ),
            ),
            scalable=True,
            attention_note="sdpa (flash on CUDA); past ~96 x scale_base positions sdpa blocks "
            "(its decay overflows a score_mod)",
        ),
        EncodingInfo(
            name="alibi",
            family="bias",
            summary="Adds -slope·distance to attention logits, one geometric slope per head.",
            reference="Press et al. 2022, Train Short, Test Long: Attention with Linear Biases "
            "Enables Input Length Extrapolation (arXiv:2108.12409)",
            implementation="worker.encodings.alibi:ALiBi",
        ),
        EncodingInfo(
            name="t5",
            family="bias",
            summary="A learned scalar per (distance bucket, head); log-spaced buckets, shared "
            "across layers.",
            reference="Raffel et al. 2020, Exploring the Limits of Transfer Learning with a "
            "Unified Text-to-Text Transformer (arXiv:1910.10683)",
            implementation="worker.encodings.t5:T5Bias",
            params=(
                Param("num_buckets", int, 32, "number of distance buckets", low=4, high=1024),
                Param(
                    "max_distance",
                    int,
                    128,
                    "distance from which every pair shares the last bucket",
                    low=8,
                    high=1 << 20,
                ),
                Param(
                    "scale",
                    float,
                    None,
                    "the learned table is multiplied by this before it is added to the "
                    "logits; it sets how fast the bias learns under Adam (default: "
                    "sqrt(head_dim), as in x-transformers)",
                    low=0.01,
                    high=1000.0,
                    derived="sqrt(head_dim)",
                ),
            ),
            check=_t5_buckets,
        ),
        EncodingInfo(
            name="kerple_log",
            family="bias",
            summary="Adds -r1·log(1 + r2·distance), r1 and r2 learned per head and kept positive.",
            reference="Chi et al. 2022, KERPLE: Kernelized Relative Positional Embedding for "
            "Length Extrapolation (arXiv:2205.09921)",
            implementation="worker.encodings.kerple:KerpleLog",
        ),
        EncodingInfo(
            name="kerple_power",
            family="bias",
            summary="Adds -r1·distance^r2 with 0 < r2 <= 2, learned per head.",
            reference="Chi et al. 2022, KERPLE: Kernelized Relative Positional Embedding for "
            "Length Extrapolation (arXiv:2205.09921)",
            implementation="worker.encodings.kerple:KerplePower",
        ),
        EncodingInfo(
            name="fire",
            family="bias",
            summary="An MLP of the log distance normalised by the log query position, with a "
            "learned threshold.",
            reference="Li et al. 2023, Functional Interpolation for Relative Positions Improves "
            "Long Context Transformers (arXiv:2310.04418)",
            implementation="worker.encodings.fire:FIRE",
            params=(
                Param("mlp_width", int, 32, "hidden width of the bias MLP", low=4, high=512),
                Param(
                    "init_c", float, 0.1, "initial c of psi(x) = log(c·x + 1)", low=1e-4, high=100.0
                ),
                Param(
                    "init_threshold",
                    float,
                    None,
                    "initial threshold L of the normaliser psi(max(L, i)) (default: a quarter "
                    "of the training length, the paper's 512 at its 2048)",
                    low=1.0,
                    high=float(1 << 22),
                    derived="train_length / 4",
                ),
            ),
        ),
        EncodingInfo(
            name="randomized",
            family="absolute",
            summary="Positions are a sorted random sample of [0, max_position) for every "
            "sequence, fed to a base encoding.",
            reference="Ruoss et al. 2023, Randomized Positional Encodings Boost Length "
            "Generalization of Transformers (arXiv:2305.16843)",
            implementation="worker.encodings.randomized:Randomized",
            params=(
                Param(
                    "base_encoding",
                    str,
                    "rope",
                    "the encoding that receives the sampled positions",
                    choices=("sinusoidal", "rope"),
                ),
                Param(
                    "max_position",
                    int,
                    None,
                    "positions are drawn from [0, max_position); must exceed the longest "
                    "evaluation length (default: 64 x the training length)",
                    low=2,
                    high=1 << 22,
                    derived="64 * train_length",
                ),
            ),
            check=_randomized_range,
        ),
        EncodingInfo(
            name="ssmax",
            family="rotary",
            summary="RoPE with scalable softmax: each query's logits times s·log n (n keys it "
            "sees), s learned per layer and head, so attention does not fade with length.",
            reference="Nakanishi 2025, Scalable-Softmax Is Superior for Attention "
            "(arXiv:2501.19399)",
            implementation="worker.encodings.ssmax:SSMax",
            params=(
                _ROPE_BASE,
                Param(
                    "init_s",
                    float,
                    None,
                    "the starting s of every layer and head (default: 1 / log of the "
                    "training length, plain softmax there at the start)",
                    low=0.0,
                    high=10.0,
                    derived="1 / log(train_length)",
                ),
            ),
            scalable=True,
        ),
        EncodingInfo(
            name="fope",
            family="rotary",
            summary="RoPE whose frequencies that do not finish a period in training are "
            "zeroed, and whose cos / sin per pair are Fourier series over the kept ones "
            "(fixed random harmonics per layer and head).",
            reference="Hua et al. 2024, Fourier Position Embedding: Enhancing Attention's "
            "Periodic Extension for Length Generalization (arXiv:2412.17739)",
            implementation="worker.encodings.fope:FoPE",
            params=(
                _ROPE_BASE,
                Param(
                    "sigma",
                    float,
                    0.3,
                    "gain of the harmonics' xavier-normal draw, sigma sqrt(2 / (K^2 + H K)) "
                    "for K kept frequencies and H heads (the paper: 0.3 at 60M parameters, "
                    "0.4 at 180M, 0.6 at 1.2B; 0 with nothing clipped is RoPE)",
                    low=0.0,
                    high=4.0,
                ),
            ),
            scalable=True,
        ),
        EncodingInfo(
            name="cope",
            family="contextual",
            summary="Positions counted by the content: key j sits at the sum of the query's "
            "sigmoid gates from j to itself, and a learned table, interpolated there, adds "
            "q·e[p] to the logit.",
            reference="Golovneva et al. 2024, Contextual Position Encoding: Learning to Count "
            "What's Important (arXiv:2405.18719)",
            implementation="worker.encodings.cope:CoPE",
            params=(
                Param(
                    "max_pos",
                    int,
                    64,
                    "entries of each layer's position table: counted positions are clamped "
                    "to max_pos - 1 (x-transformers' default: 16)",
                    low=2,
                    high=1 << 16,
                ),
            ),
            attention_note="eager (its term depends on the scores: no fused form)",
        ),
        EncodingInfo(
            name="local_global",
            family="rotary",
            summary="Local layers (RoPE, a sliding window) and global ones (RoPE of a larger "
            "base, or NoPE), pattern local : 1 global, repeated over the depth.",
            reference="Gemma Team 2024-25, Gemma 2 and Gemma 3 technical reports "
            "(arXiv:2408.00118, arXiv:2503.19786); Cohere 2025, Command A (arXiv:2504.00698)",
            implementation="worker.encodings.layered:LocalGlobal",
            params=(
                Param(
                    "pattern",
                    int,
                    5,
                    "local layers per global one, from the first layer (Gemma 3: 5, "
                    "Cohere2: 3); layer i is global when (i + 1) % (pattern + 1) == 0",
                    low=1,
                    high=63,
                ),
                Param(
                    "window",
                    int,
                    None,
                    "the local layers' sliding window: each query sees itself and the "
                    "window - 1 keys before it (the global layers see every key)",
                    low=1,
                    high=1 << 22,
                    derived="train_length / 4",
                ),
                Param("local_base", float, 10000.0, "the local layers' RoPE base", low=2.0),
                Param(
                    "global_base",
                    float,
                    1000000.0,
                    "the global layers' RoPE base (Gemma 3: 1,000,000)",
                    low=2.0,
                ),
                Param(
                    "global",
                    str,
                    "rope",
                    "the global layers' encoding: rope (Gemma) or nope (Cohere2)",
                    choices=("rope", "nope"),
                ),
            ),
            scalable=True,
            check=_local_global_fits,
            scaling_check=_local_global_scaling,
            recipe=True,
            attention_note="sdpa blocks (flex block masks on CUDA); global layers: sdpa",
        ),
        EncodingInfo(
            name="irope",
            family="rotary",
            summary="RoPE layers with a NoPE layer every few (iRoPE); optional chunked "
            "attention on the RoPE layers and a query temperature on the NoPE ones.",
            reference="Meta 2025, The Llama 4 herd (model card; transformers' Llama4 "
            "no_rope_layers); Hugging Face 2025, SmolLM3 (blog, NoPE every 4th layer)",
            implementation="worker.encodings.layered:IRope",
            params=(
                Param(
                    "every",
                    int,
                    4,
                    "every every-th layer is NoPE (layer i when (i + 1) % every == 0), "
                    "the others RoPE (Llama 4, SmolLM3: 4)",
                    low=2,
                    high=64,
                ),
                _ROPE_BASE,
                Param(
                    "chunk",
                    int,
                    None,
                    "chunked attention on the RoPE layers: positions attend only within "
                    "their chunk of this many tokens (Llama 4: 8192); unset: none",
                    low=1,
                    high=1 << 22,
                    derived="none",
                    optional=True,
                ),
                Param(
                    "temperature",
                    int,
                    None,
                    "Llama 4's query temperature on the NoPE layers: q x (1 + 0.1 "
                    "log(floor((p + 1) / temperature) + 1)) at position p (Llama 4: "
                    "8192); unset: none",
                    low=1,
                    high=1 << 22,
                    derived="none",
                    optional=True,
                ),
            ),
            scalable=True,
            check=_irope_fits,
            recipe=True,
            attention_note="sdpa (flash on CUDA); chunked RoPE layers: sdpa blocks (flex "
            "block masks on CUDA)",
        ),
    )
}


def hf_exportable() -> list[str]:
    """The encodings `posbench export-hf` writes as HF transformers models."""
    return [name for name, entry in REGISTRY.items() if entry.hf_export]


def info(name: str) -> EncodingInfo:
    """The registry entry for ``name``, or a readable error listing what exists."""
    try:
        return REGISTRY[name]
    except KeyError:
        hint = (
            " (RoPE scalings are evaluation variants: eval.variants, e.g. [none, yarn:auto])"
            if name in SCALINGS
            else ""
        )
        raise EncodingConfigError(
            f"unknown encoding {short_repr(name)} (available: {', '.join(REGISTRY)}){hint}"
        ) from None
