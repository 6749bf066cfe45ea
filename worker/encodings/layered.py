"""Layer recipes: one encoding per kind of layer, repeated over the depth, as the models of
2025-26 combine them (their length behaviour comes from the mix).

- ``local_global`` (Gemma 2 / 3, Cohere2): ``pattern`` local layers, then one global,
  repeated from the first layer (layer i is global when (i + 1) % (pattern + 1) == 0,
  transformers' ``layer_types``). Local layers: RoPE with ``local_base`` and a sliding
  ``window``; global layers: RoPE with ``global_base`` over every earlier key, or NoPE
  (``global: nope``, Cohere2). A RoPE scaling applies to the global layers only, as
  Gemma 3's ``rope_scaling`` does; with NoPE global layers there is nothing to scale.
- ``irope`` (Llama 4, SmolLM3): every ``every``-th layer NoPE (layer i when
  (i + 1) % every == 0, Llama 4's ``no_rope_layers``), RoPE with ``base`` on the others;
  optionally chunked attention on the RoPE layers (``chunk`` tokens attend among
  themselves, Llama 4's ``attention_chunk_size``) and Llama 4's query temperature on the
  NoPE layers, q x (1 + 0.1 log(floor((p + 1) / temperature) + 1)) at position p. A RoPE
  scaling applies to the RoPE layers.

A recipe is a ``PositionEncoding`` whose kinds are ordinary encodings (``Rope``,
``NoPE``): the model asks it which kind each layer is (``layer_kinds``), what each kind's
attention sees (``reach``: a window, chunks) and what multiplies its queries
(``query_factors``), then builds each kind's tables once per pass as it does for a plain
encoding. A recipe with one kind is that encoding, number for number.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from core.catalog.params import EncodingConfigError
from worker.encodings.base import PositionEncoding
from worker.encodings.nope import NoPE
from worker.encodings.rope import Rope
from worker.encodings.rotary import RotaryTables
from worker.reach import CAUSAL, Reach

# Llama 4's attn_scale: the slope of the NoPE layers' query temperature in log steps.
TEMPERATURE_SLOPE = 0.1


class Layered(PositionEncoding):
    """Kinds of layers, each with its own encoding, attention reach and query factors."""

    def __init__(self, kinds: list[PositionEncoding], **dims: int) -> None:
        super().__init__(**dims)
        if any(kind.has_bias for kind in kinds):
            raise ValueError("a recipe's kinds are rotary or position-free: no bias kind")
        self.kinds = nn.ModuleList(kinds)
        # What a RoPE scaling changes: the kinds that take it.
        self.scaled_kinds: tuple[int, ...] = ()

    def layer_kinds(self, n_layers: int) -> list[int]:
        """The kind of each of ``n_layers`` layers (an index into ``kinds``)."""
        raise NotImplementedError

    def reach(self, kind: int) -> Reach:
        """Which earlier keys the layers of ``kind`` see."""
        return CAUSAL

    def query_factors(self, kind: int, positions: Tensor) -> Tensor | None:
        """What multiplies the queries of ``kind`` at ``positions [T]`` (None: nothing)."""
        return None

    # -- one layer's view: the primary kind ------------------------------------------------
    # What shows a recipe as one attention layer (the Explore page, the equivariance probe):
    # the kind a RoPE scaling changes (the global layers, the RoPE layers), else the first.
    # The model itself reads each layer's own kind.

    @property
    def primary(self) -> PositionEncoding:
        return self.kinds[self.scaled_kinds[0] if self.scaled_kinds else 0]

    def rotary_tables(self, positions: Tensor) -> RotaryTables | None:
        return self.primary.rotary_tables(positions)

    @property
    def inv_freq(self) -> Tensor:
        return self.primary.inv_freq

    def angular_speeds(self, length: int) -> Tensor:
        return self.primary.angular_speeds(length)

    def with_scaling(
        self,
        method: str,
        factor: float | None = None,
        original_length: int | None = None,
        **params: object,
    ) -> Layered:
        """A copy whose scaled kinds carry the inference-time scaling; this one unchanged."""
        if not self.scaled_kinds:
            raise EncodingConfigError(
                f"RoPE scaling {method!r}: {self.name} has no layer it applies to here"
            )
        scaled = copy.deepcopy(self)
        for kind in self.scaled_kinds:
            rope = self.kinds[kind]
            assert isinstance(rope, Rope)
            scaled.kinds[kind] = rope.with_scaling(method, factor, original_length, **params)
        return scaled

    @property
    def scaling(self):
        for kind in self.scaled_kinds:
            return getattr(self.kinds[kind], "scaling", None)
        return None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaled kinds={list(self.scaled_kinds)}"


def _rope(base: float, dims: dict[str, int]) -> Rope:
    return Rope(base=base, **dims)


class LocalGlobal(Layered):
    name = "local_global"
    LOCAL, GLOBAL = 0, 1

    def __init__(
        self,
        *,
        pattern: int = 5,
        window: int | None = None,
        local_base: float = 10000.0,
        global_base: float = 1000000.0,
        **dims: int,
    ) -> None:
        global_kind = str(dims.pop("global", "rope"))  # the parameter's name is a keyword
        train_length = dims["train_length"]
        kinds: list[PositionEncoding] = [
            _rope(local_base, dims),
            _rope(global_base, dims) if global_kind == "rope" else NoPE(**dims),
        ]
        super().__init__(kinds, **dims)
        self.pattern = pattern
        self.window = window if window is not None else max(1, train_length // 4)
        self.global_kind = global_kind
        self.scaled_kinds = (self.GLOBAL,) if global_kind == "rope" else ()

    def layer_kinds(self, n_layers: int) -> list[int]:
        cycle = self.pattern + 1
        return [self.GLOBAL if (i + 1) % cycle == 0 else self.LOCAL for i in range(n_layers)]

    def reach(self, kind: int) -> Reach:
        return Reach(window=self.window) if kind == self.LOCAL else CAUSAL

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, pattern={self.pattern}:1, window={self.window}, "
            f"global={self.global_kind}"
        )


class IRope(Layered):
    name = "irope"
    ROPE, NOPE = 0, 1

    def __init__(
        self,
        *,
        every: int = 4,
        base: float = 10000.0,
        chunk: int | None = None,
        temperature: int | None = None,
        **dims: int,
    ) -> None:
        super().__init__([_rope(base, dims), NoPE(**dims)], **dims)
        self.every = every
        self.chunk = chunk
        self.temperature = temperature
        self.scaled_kinds = (self.ROPE,)

    def layer_kinds(self, n_layers: int) -> list[int]:
        return [self.NOPE if (i + 1) % self.every == 0 else self.ROPE for i in range(n_layers)]

    def reach(self, kind: int) -> Reach:
        return Reach(chunk=self.chunk) if kind == self.ROPE and self.chunk else CAUSAL

    def query_factors(self, kind: int, positions: Tensor) -> Tensor | None:
        if kind != self.NOPE or self.temperature is None:
            return None
        steps = torch.floor((positions.to(torch.float32) + 1.0) / self.temperature)
        return 1.0 + TEMPERATURE_SLOPE * torch.log1p(steps)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, NoPE every {self.every}, chunk={self.chunk}, "
            f"temperature={self.temperature}"
        )
