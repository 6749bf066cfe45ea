"""Position encodings, registered by name.

    from worker.encodings import REGISTRY, build
    enc = build("alibi", n_heads=8, head_dim=64, d_model=512, train_length=512)

Importing this package does not import torch; :func:`build` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from core.catalog.encodings import (
    REGISTRY,
    SCALINGS,
    SHARED_PARAMS,
    EncodingInfo,
    Fit,
    ScalingInfo,
    info,
    scaling_info,
)
from core.catalog.params import EncodingConfigError, Param, is_positive_int

if TYPE_CHECKING:
    from worker.encodings.base import PositionEncoding

__all__ = [
    "REGISTRY",
    "SCALINGS",
    "EncodingConfigError",
    "EncodingInfo",
    "Param",
    "ScalingInfo",
    "build",
    "info",
    "scaling_info",
]


# The longest training length an encoding is built for (the spec allows 16k; a learned
# table this long is already 4M x d_model).
MAX_TRAIN_LENGTH = 1 << 22


def _check_dims(n_heads: int, head_dim: int, d_model: int, train_length: int) -> None:
    for label, value in (
        ("n_heads", n_heads),
        ("head_dim", head_dim),
        ("d_model", d_model),
        ("train_length", train_length),
    ):
        if not is_positive_int(value):
            raise EncodingConfigError(f"{label} must be a positive integer, got {value!r}")
    if d_model != n_heads * head_dim:
        raise EncodingConfigError(
            f"d_model={d_model} must equal n_heads x head_dim = {n_heads} x {head_dim}"
        )
    if train_length > MAX_TRAIN_LENGTH:
        raise EncodingConfigError(
            f"train_length={train_length} exceeds the limit of {MAX_TRAIN_LENGTH:,}"
        )


def build(
    name: str,
    *,
    n_heads: int,
    head_dim: int,
    d_model: int,
    train_length: int,
    **params: Any,
) -> PositionEncoding:
    """Instantiate the encoding ``name`` for a model of the given shape.

    Parameters are checked against the registry (unknown names and out-of-range
    values raise :class:`EncodingConfigError` with the allowed range).
    """
    entry = info(name)
    _check_dims(n_heads, head_dim, d_model, train_length)
    resolved = entry.resolve(params)
    own = {p.name for p in entry.params}
    shared = [p.name for p in SHARED_PARAMS if p.name in resolved and p.name not in own]
    if shared:
        raise EncodingConfigError(
            f"{', '.join(shared)}: the model's attention, not the encoding's "
            "(worker.model.build_model applies it)"
        )
    problems = entry.problems(resolved, Fit(head_dim, train_length, train_length))
    if problems:
        raise EncodingConfigError(f"encoding {name!r}: {'; '.join(problems)}")
    module_name, class_name = entry.implementation.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(
        n_heads=n_heads, head_dim=head_dim, d_model=d_model, train_length=train_length, **resolved
    )
