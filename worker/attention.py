"""Which attention kernel runs, and the fused one for encodings that act on the logits.

Four implementations, named as HF transformers names them (``attn_implementation``):

- ``eager``: the scores written out, softmax, then the values, in blocks of query rows
  (the reference every other path is held to);
- ``sdpa``: ``scaled_dot_product_attention``; flash on a GPU where no bias is needed,
  an additive mask per block of query rows where one is (ALiBi, T5, KERPLE, FIRE);
- ``flex_attention``: PyTorch's compiled fused kernel (``torch.nn.attention.flex_attention``)
  with the encoding's bias as a ``score_mod`` and the causal mask (and a sliding window)
  as a block mask: no bias matrix, fully masked tiles skipped;
- ``auto``: flex on CUDA for an encoding with a bias, sdpa otherwise (on the CPU a learned
  bias in training is written out, where SDPA's CPU kernel would materialise every score
  anyway).

The choice changes no number beyond rounding (tests hold them to 1e-5 in float32) and no
hash: like the device it is how a run executes, recorded in its provenance. What cannot
run as asked runs on the next path with a note, printed once per model: FlexAttention has
no backward on the CPU (torch 2.13), so flex trains through sdpa there; xPos's decay past
one table's span overflows a ``score_mod`` and stays on query blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from worker.catalog.models import ATTN_IMPLEMENTATIONS

log = logging.getLogger("posbench.attention")

# (head, query, key) index tensors -> the bias those pairs get (worker.encodings.base).
BiasMod = Callable[[Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

# Distinct compiled shapes a process may hold: one per (length, heads, head size, dtype,
# bias form) of an evaluation sweep. Past Dynamo's own limit (8 by default) flex would
# silently run uncompiled, writing out every score; the limit is raised to this, and a
# shape beyond it runs on sdpa with a note instead.
MAX_FLEX_SHAPES = 256


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # torch < 2.5
        return False
    return True


@dataclass(frozen=True)
class Choice:
    """What runs for one forward pass: ``implementation`` (eager, sdpa or flex_attention)
    and, where it is not what was asked, the one-line reason."""

    implementation: str
    note: str | None = None


def choose(
    requested: str,
    *,
    device: torch.device,
    has_bias: bool,
    fusable: bool,
    backward: bool,
    learned: bool = False,
    decay: bool = False,
) -> Choice:
    """The implementation a pass runs with: ``requested`` (auto, eager, sdpa,
    flex_attention) for an encoding with an additive bias (``has_bias``; ``learned``: with
    parameters of its own) that has a fused form (``fusable``), on ``device``, with or
    without a ``backward`` to follow; ``decay``: xPos's per-block decay is in use."""
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, "
            f"got {requested!r}"
        )
    if decay:
        note = None
        if requested in ("eager", "flex_attention"):
            note = (
                f"xpos past one table's span runs on sdpa, not {requested}: its decay "
                "overflows a score_mod and is applied per block of queries"
            )
        return Choice("sdpa", note)
    if requested == "auto":
        if device.type == "cuda" and has_bias and fusable and flex_available():
            return Choice("flex_attention")
        if device.type == "cpu" and has_bias and learned and backward:
            # PyTorch's fused CPU kernel writes every score out with a learned bias and is
            # slower than doing it ourselves (worker.model.written_out).
            return Choice("eager")
        return Choice("sdpa")
    if requested != "flex_attention":
        return Choice(requested)
    if not flex_available():
        return Choice("sdpa", f"FlexAttention needs torch >= 2.5 (this is {torch.__version__})")
    if has_bias and not fusable:
        return Choice("sdpa", "this encoding's bias has no score_mod; it runs on sdpa")
    if backward and device.type == "cpu":
        return Choice(
            "sdpa",
            "FlexAttention has no backward on the CPU: training runs on sdpa, "
            "evaluation on flex_attention",
        )
    return Choice("flex_attention")


class Notes:
    """Each distinct note logged once for the lifetime of its owner (a model)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def tell(self, note: str | None) -> None:
        if note is not None and note not in self.seen:
            self.seen.append(note)
            log.warning("attention: %s", note)


# -- the fused kernel -----------------------------------------------------------------------


def causal_mask_mod(window: int | None = None) -> Callable[..., Tensor]:
    """Key j visible from query i: j <= i, and i - j < ``window`` when one is given
    (sliding-window layers)."""

    def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return q >= kv

    if window is None:
        return causal

    def windowed(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (q - kv < window)

    return windowed


@torch.compiler.disable
def block_mask(length: int, device: str, window: int | None = None, causal: bool = True):
    """The causal (or windowed) block mask of ``length`` x ``length``, built once per
    length and device and shared by every layer, head and batch; None when nothing is
    masked (two-way probes). Outside any compiled graph: a lookup in a cache."""
    return _block_mask(length, device, window) if causal else None


@lru_cache(maxsize=64)
def _block_mask(length: int, device: str, window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        causal_mask_mod(window), None, None, length, length, device=device, _compile=False
    )


def score_mod(bias: BiasMod | None, factors: Tensor | None) -> ScoreMod | None:
    """``score + bias(h, q, kv)``, the bias multiplied by the query's log-n factor where
    there is one (its q is scaled by the same factor before the kernel)."""
    if bias is None:
        return None
    if factors is None:

        def biased(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return score + bias(h, q, kv)

        return biased

    def biased_and_scaled(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return score + bias(h, q, kv) * factors[q]

    return biased_and_scaled


_kernel: Callable[..., Tensor] | None = None
_shapes: set[tuple] = set()


def compiled_shapes() -> int:
    """Distinct shapes the compiled kernel has been called with in this process (each one
    compile: a sweep over lengths compiles once per length)."""
    return len(_shapes)


def _compiled_kernel() -> Callable[..., Tensor]:
    global _kernel
    if _kernel is None:
        from torch.nn.attention.flex_attention import flex_attention

        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        name = "recompile_limit" if limit is not None else "cache_size_limit"
        current = getattr(torch._dynamo.config, name)
        setattr(torch._dynamo.config, name, max(current, MAX_FLEX_SHAPES))
        # Static shapes: dynamic ones fail to build on the CPU in torch 2.13, and a sweep
        # has a handful of lengths.
        _kernel = torch.compile(flex_attention, dynamic=False)
    return _kernel


def fits_compiled(key: tuple) -> bool:
    """Whether a call of this ``key`` (its shape, dtype, device and bias form) is compiled
    already or may be compiled (below MAX_FLEX_SHAPES); the caller runs sdpa where not."""
    if key in _shapes:
        return True
    if len(_shapes) >= MAX_FLEX_SHAPES:
        return False
    _shapes.add(key)
    return True


def flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mod: ScoreMod | None,
    *,
    causal: bool = True,
    window: int | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) v in one fused kernel, ``q, k, v [B, H, T, d]``."""
    mask = block_mask(q.shape[-2], str(q.device), window, causal)
    if torch.compiler.is_compiling():  # the model is compiled: the outer compile fuses it
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=mod, block_mask=mask)
    return _compiled_kernel()(q, k, v, score_mod=mod, block_mask=mask)


@dataclass(frozen=True)
class Kernel:
    """One forward pass's attention: the ``implementation`` that runs and, for flex, the
    ``score_mod`` every layer shares (None: the mask alone)."""

    implementation: str
    score_mod: ScoreMod | None = None
