"""Log-n scaling and the attention probe inside an HF transformers model.

HF's attention modules look their attention function up by name in
``AttentionInterface``. posbench registers one more, ``posbench_sdpa``: PyTorch's SDPA as
HF runs it (``sdpa_attention_forward``, with SDPA's own masks), after two optional steps
on the rotated queries and keys a pass asks for through ``attending``:

- the query at position n (1-based) multiplied by max(1, log n / log L), as Qwen's
  ``use_logn_attn`` does (``worker.diagnostics.logn_factors``);
- the attention of the probe's sampled queries written out and recorded
  (``worker.diagnostics.AttentionProbe``), from the same q, k, scaling and mask.

A pass asking for neither runs HF's own ``sdpa`` untouched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from worker.attention import additive_mask
from worker.diagnostics import ROWS_AT_ONCE, AttentionProbe, scale_rows
from worker.reach import Reach

IMPLEMENTATION = "posbench_sdpa"
_PASS = "_posbench_pass"  # the attribute an attention module reads its pass from


def _additive(mask: Tensor | None) -> Tensor | None:
    """HF's mask as additive float rows (bool: True attends), or None."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return additive_mask(mask, torch.float32)


def _posbench_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    factors, probe = getattr(module, _PASS, (None, None))
    query = scale_rows(query, factors)
    if probe is not None:
        groups = query.shape[1] // key.shape[1]
        keys = key.repeat_interleave(groups, dim=1) if groups > 1 else key
        mask = _additive(attention_mask)
        length = query.shape[-2]
        rows = max(ROWS_AT_ONCE, math.ceil(length * ROWS_AT_ONCE / probe.sample))
        probe.record_sampled(
            module.layer_idx,
            query,
            keys,
            block_rows=rows,
            bias_rows=None if mask is None else (lambda s, e: mask[..., s:e, :e]),
            scale=scaling,
            reach=layer_reach(module),
        )
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, **kwargs
    )


def layer_reach(module: nn.Module) -> Reach:
    """Which keys the layer of an HF attention ``module`` sees, from its config's
    ``layer_types``: a sliding window (Gemma, Cohere2), chunks (Llama 4), or every earlier
    key; what the probe normalises a query's entropy by (its mask already hides them)."""
    config = module.config
    kinds = getattr(config, "layer_types", None)
    kind = kinds[module.layer_idx] if kinds else "full_attention"
    window = getattr(config, "sliding_window", None) if kind == "sliding_attention" else None
    chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
    return Reach(window=window, chunk=chunk)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, _posbench_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The HF ``model``'s attention modules: those that call an attention function with
    their layer's index and scaling."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]


@contextlib.contextmanager
def attending(
    model: nn.Module,
    modules: list[nn.Module],
    factors: Tensor | None,
    probe: AttentionProbe | None,
) -> Iterator[None]:
    """One pass of the HF ``model`` (its attention ``modules``) with log-n ``factors`` and
    the ``probe`` (neither: HF's own sdpa, untouched)."""
    if factors is None and probe is None:
        yield
        return
    _register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    for module in modules:
        setattr(module, _PASS, (factors, probe))
    try:
        yield
    finally:
        config._attn_implementation = before
        for module in modules:
            delattr(module, _PASS)
