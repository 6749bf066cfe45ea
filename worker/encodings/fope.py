"""FoPE, Fourier position embedding (Hua et al. 2024, arXiv:2412.17739; ICML 2025).

RoPE gives rotated pair m of a head one frequency w_m. FoPE reads two things into how a
model actually uses it, and changes RoPE where they hurt length generalisation:

- **Clip to floor.** A frequency that does not complete one period within the training
  length L (w_m < 2 pi / L) is never seen over a whole turn in training; past L its
  phases are new. FoPE sets it to zero: those pairs carry no position at all.
- **Fourier series.** Each kept pair's cos and sin become series over every kept
  frequency, the pair's own as the dominant term and the others as weak harmonics:

      cos_m(n) = sum_k C[h, k, m] cos(w_k n),   sin_m(n) = sum_k S[h, k, m] sin(w_k n)

  with C and S per layer and head, the identity plus Gaussian noise, fixed from the start
  (the authors' default, ``fourier_learnable: false``). The noise's std is the authors'
  xavier-normal of the [heads, K, K] tensor at gain ``sigma``: sigma sqrt(2 / (K^2 + H K)),
  K the kept frequencies (their Table 3: sigma 0.3 at 60M parameters, 0.4 at 180M, 0.6 at
  1.2B).

The pair (x1, x2) at position n becomes (x1 cos_m - x2 sin_m, x2 cos_m + x1 sin_m), RoPE's
rotation with the mixed tables, for queries and keys alike. The clipped pairs take cos =
sin = 1 (the authors' code and vLLM's FourierRotaryEmbedding pad both tables with ones):
a fixed turn by 45 degrees, scaled by sqrt(2), the same at every position, so q.k there
is twice the plain product and carries no position. With sigma = 0 and no pair clipped,
FoPE is RoPE number for number. The inference-time scalings (PI, YaRN, ...) apply to the
kept frequencies of every layer, the coefficients unchanged (the paper's FoPE + YaRN).

Each layer has its own C and S, so the encoding is a layer recipe with one kind per
layer (``worker.encodings.layered``); the model binds it to its depth before anything
trains (``bind_layers``), drawing the coefficients from a stream fixed at construction
(so from the run's seed).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from worker.encodings.layered import Layered
from worker.encodings.rope import Rope
from worker.encodings.rotary import RotaryTables


def kept_frequencies(inv_freq: Tensor, train_length: int) -> Tensor:
    """Which of RoPE's frequencies complete a period within ``train_length`` (the rest are
    clipped to zero): ``w >= 2 pi / L``, the authors' floor."""
    return inv_freq >= 2.0 * math.pi / train_length


def harmonic_std(sigma: float, heads: int, kept: int) -> float:
    """The std of the harmonic coefficients: xavier-normal of a [heads, K, K] tensor."""
    return sigma * math.sqrt(2.0 / (kept * kept + heads * kept))


class FourierLayer(Rope):
    """One layer's FoPE: RoPE's ladder with its kept frequencies mixed per head."""

    name = "fope"

    def __init__(
        self, *, sigma: float = 0.3, generator: torch.Generator | None = None, **params: object
    ) -> None:
        super().__init__(**params)  # type: ignore[arg-type]
        self.sigma = sigma
        keep = kept_frequencies(self.inv_freq, self.train_length)
        kept = int(keep.sum())
        self.kept = kept
        eye = torch.eye(kept).expand(self.n_heads, kept, kept)
        std = harmonic_std(sigma, self.n_heads, kept) if kept else 0.0
        shape = (self.n_heads, kept, kept)
        # Persistent: a checkpoint carries the draws its model trained with.
        self.register_buffer("cos_coef", eye + std * torch.randn(shape, generator=generator))
        self.register_buffer("sin_coef", eye + std * torch.randn(shape, generator=generator))
        # Fixed at the training frequencies: a scaling moves the kept ones, clips no more.
        self.register_buffer("keep", keep.nonzero().flatten(), persistent=False)

    def rotary_tables(self, positions: Tensor) -> RotaryTables:
        """``[H, T, r/2]`` (``[B, H, T, r/2]`` for per-sequence positions) mixed tables."""
        with torch.autocast(positions.device.type, enabled=False):
            # RoPE's phases (a scaling's frequencies, PI's divided positions) of the kept.
            angle = self.phases(positions)[..., self.keep]  # [..., T, K]
            cos = torch.einsum("...tk,hkm->...htm", angle.cos(), self.cos_coef)
            sin = torch.einsum("...tk,hkm->...htm", angle.sin(), self.sin_coef)
            factor = self.attention_factor  # YaRN's temperature: the whole table, as RoPE's
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            clipped = self.rotary_dim // 2 - self.kept
            if clipped:
                ones = cos.new_ones((*cos.shape[:-1], clipped))
                cos, sin = torch.cat((cos, ones), -1), torch.cat((sin, ones), -1)
            return RotaryTables(cos, sin, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, sigma={self.sigma:g}, kept {self.kept} of "
            f"{self.rotary_dim // 2} frequencies"
        )


class FoPE(Layered):
    """FoPE on every layer, each with its own coefficients."""

    name = "fope"

    def __init__(self, *, base: float = 10000.0, sigma: float = 0.3, **dims: int) -> None:
        # Drawn from the stream the model builds encodings under (the run's seed): every
        # layer's coefficients follow from it, whenever the model binds the depth.
        self.stream_seed = int(torch.randint(0, 2**62, ()).item())
        self.base, self.sigma = base, sigma
        super().__init__([self._layer(0, dims)], **dims)
        # A RoPE scaling moves every layer's kept frequencies (the paper's FoPE + YaRN).
        self.scaled_kinds = (0,)

    def _layer(self, index: int, dims: dict[str, int]) -> FourierLayer:
        generator = torch.Generator().manual_seed(self.stream_seed + index)
        return FourierLayer(base=self.base, sigma=self.sigma, generator=generator, **dims)

    def bind_layers(self, n_layers: int) -> None:
        """One kind per layer, each with its own C and S (layer 0 keeps its draw)."""
        if len(self.kinds) == n_layers:
            return
        dims = {
            "n_heads": self.n_heads,
            "head_dim": self.head_dim,
            "d_model": self.d_model,
            "train_length": self.train_length,
        }
        device = self.kinds[0].cos_coef.device
        layers = [self._layer(i, dims).to(device) for i in range(n_layers)]
        self.kinds = torch.nn.ModuleList(layers)
        self.scaled_kinds = tuple(range(n_layers))

    def layer_kinds(self, n_layers: int) -> list[int]:
        return list(range(n_layers))

    def extra_repr(self) -> str:
        first = self.kinds[0]
        return (
            f"n_heads={self.n_heads}, head_dim={self.head_dim}, train_length="
            f"{self.train_length}, base={self.base:g}, sigma={self.sigma:g}, kept "
            f"{first.kept} of {first.rotary_dim // 2} frequencies, {len(self.kinds)} layers"
        )
