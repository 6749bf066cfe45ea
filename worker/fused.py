"""The fused kernel: PyTorch's FlexAttention (``torch.nn.attention.flex_attention``),
compiled, with an encoding's bias as a ``score_mod`` (log-n factors and a soft cap
composed into it) and a layer's reach (the causal mask, a sliding window, chunks) as a
block mask, so that no bias matrix is built and fully masked tiles are skipped.

``worker.attention`` chooses when it runs; this module builds what it runs with (the
block masks, once per length; the score_mod, once per pass) and keeps count of the
shapes compiled in the process, past which a pass runs on sdpa with a note.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from worker.encodings.base import BiasMod
from worker.reach import CAUSAL, Reach

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

# Distinct compiled shapes a process may hold: one per (length, heads, head size, dtype,
# bias form) of an evaluation sweep. Past Dynamo's own limit (8 by default) flex would
# silently run uncompiled, writing out every score; the limit is raised to this, and a
# shape beyond it runs on sdpa with a note instead.
MAX_FLEX_SHAPES = 256


def _has_flex() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # torch < 2.5
        return False
    return True


# Known once at import: a compiled forward asks it on every trace.
FLEX_AVAILABLE = _has_flex()


# -- the fused kernel -----------------------------------------------------------------------


@torch.compiler.disable
def block_mask(length: int, device: str, reach: Reach = CAUSAL, causal: bool = True):
    """The causal block mask of ``length`` x ``length`` under ``reach``, built once per
    length and device and shared by every layer, head and batch; None when nothing is
    masked (two-way probes). Outside any compiled graph: a lookup in a cache."""
    return _block_mask(length, device, reach) if causal else None


@lru_cache(maxsize=64)
def _block_mask(length: int, device: str, reach: Reach):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        reach.mask_mod(), None, None, length, length, device=device, _compile=False
    )


def score_mod(
    bias: BiasMod | None, factors: Tensor | None, softcap: float | None = None
) -> ScoreMod | None:
    """``score + bias(h, q, kv)``, the bias multiplied by the query's log-n factor where
    there is one (its q is scaled by the same factor before the kernel); with a
    ``softcap``, that soft-capped (cap x tanh(. / cap)), as the written-out path does."""
    if softcap is not None:
        inner = score_mod(bias, factors)

        def capped(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            logit = score if inner is None else inner(score, b, h, q, kv)
            return torch.tanh(logit / softcap) * softcap

        return capped
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

        config = torch._dynamo.config
        per_frame = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, per_frame, max(getattr(config, per_frame), MAX_FLEX_SHAPES))
        if hasattr(config, "accumulated_recompile_limit"):  # all frames together
            limit = max(config.accumulated_recompile_limit, 4 * MAX_FLEX_SHAPES)
            config.accumulated_recompile_limit = limit
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


def kernel_options(tiles: dict[str, int] | None, device: torch.device) -> dict[str, int] | None:
    """The kernel options flex_attention is called with: the bias's tiles on a GPU (a copy:
    the compiler may keep it), none on the CPU, whose kernel tiles another way."""
    return dict(tiles) if tiles and device.type == "cuda" else None


def flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mod: ScoreMod | None,
    *,
    mask: Any = None,
    causal: bool = True,
    reach: Reach = CAUSAL,
    tiles: dict[str, int] | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) v in one fused kernel, ``q, k, v [B, H, T, d]``,
    under ``mask`` (a pass's block mask) or the causal one of this length and ``reach``.
    ``tiles``: the kernel options the bias needs on a GPU (``flex_tiles``); the CPU's
    kernel has no tiles of this kind and takes none."""
    if mask is None:
        mask = block_mask(q.shape[-2], str(q.device), reach, causal)
    options = kernel_options(tiles, q.device)
    if torch.compiler.is_compiling():  # the model is compiled: the outer compile fuses it
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=mod, block_mask=mask, kernel_options=options)
    return _compiled_kernel()(q, k, v, score_mod=mod, block_mask=mask, kernel_options=options)


@dataclass(frozen=True)
class Kernel:
    """One forward pass's attention: the ``implementation`` that runs and, for flex, the
    ``score_mod`` every layer shares (None: the mask alone)."""

    implementation: str
    score_mod: ScoreMod | None = None
    # flex's block masks, one per reach the layers use (a sliding window, chunks),
    # looked up once per pass (outside a compiled graph).
    block_masks: dict[Reach, Any] | None = None
    tiles: dict[str, int] | None = None  # the bias's kernel options (``flex_tiles``)

    def block_mask(self, reach: Reach = CAUSAL) -> Any:
        """The pass's block mask for a layer with this ``reach`` (None: built on demand)."""
        return (self.block_masks or {}).get(reach)
