"""Why a curve bends: what attention does at each evaluation length, and log-n scaling.

**Diagnostics** (``eval.diagnostics``). At every (variant, protocol, length) a probe
reads each layer's queries and keys as the model computed them (rotated, biased,
scaled: what the softmax sees) and, beside the fast kernels, writes the attention of a
bounded sample of query positions out explicitly (``QUERY_SAMPLE`` per window, evenly
spaced, always the last). It never changes what the model computes: the fused kernels
run as without it, so every other number of the point is bit-identical. Per head and
layer, averaged over the sampled queries of every window:

- ``entropy``: -sum_j p_j log p_j in nats; ``normalised_entropy`` divides it by log of
  the number of keys the query sees (1: uniform attention, 0: one key; a query that
  sees a single key, the first of a chunk, counts 0);
- ``distance``: the expected distance sum_j p_j (i - j);
- ``sink_mass``: the attention on the first ``SINK_TOKENS`` tokens (attention sinks,
  Xiao et al. 2023);
- ``beyond_mass``: the attention on keys farther than the training length L allowed
  (distance >= L: farther than any query saw in training; 0 up to 1x);
- ``max_logit``: the query's largest pre-softmax logit.

**Log-n scaling** (Chiang & Cholak 2022; Qwen's ``use_logn_attn``): the attention logits
of the query at position n (1-based: the keys it sees) multiplied by
max(1, log n / log L). Without an additive bias that is the query scaled by the factor,
as Qwen does; with one (ALiBi, T5, KERPLE, FIRE) the bias is multiplied too, so the
factor is a temperature on the whole logit (Scalable-Softmax, Nakanishi 2025). Up to L
every factor is 1 and nothing is touched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from worker.encodings.rotary import scale_pairs

# Query positions sampled per window; the sampled queries after which a point records no
# further window (whole windows from its first: past it by less than one window where a
# window holds fewer than QUERY_SAMPLE); the first tokens whose mass is the sink's.
QUERY_SAMPLE = 256
QUERY_BUDGET = 2048
SINK_TOKENS = 4
# What the probe measures, in the order of its tally (core.metrics names the metric
# each one is stored as, ``Metric.diagnostic``).
STATS = ("entropy", "normalised_entropy", "distance", "sink_mass", "beyond_mass", "max_logit")
# The logit of a masked key where the probe writes one out.
MASKED = float("-inf")
# Per-head values are stored while layers x heads stay within this.
MAX_STORED_HEADS = 1024
# Sampled query rows written out at once by a model without query blocks (hf:).
ROWS_AT_ONCE = 32


def logn_factors(
    length: int, train_length: int, device: torch.device, start: int = 0
) -> Tensor | None:
    """``[length - start]`` float32 factors max(1, log n / log L) for the queries at
    positions start..length-1 (n = position + 1); None when ``length <= L`` (every
    factor 1)."""
    if train_length < 2:
        raise ValueError(f"log-n scaling needs a training length >= 2, got {train_length}")
    if length <= train_length:
        return None
    n = torch.arange(start + 1, length + 1, dtype=torch.float64)
    factors = (n.log() / math.log(train_length)).clamp(min=1.0)
    return factors.to(device=device, dtype=torch.float32)


def scale_rows(x: Tensor, factors: Tensor | None) -> Tensor:
    """``x [..., T, d]`` with row t multiplied by ``factors[..., t]`` (``[T]``, or per head
    ``[H, T]``; in float32, rounded once to x's dtype); x itself without factors.
    Queries, and the bias rows or masks of the same queries ``[..., T, keys]``, are
    scaled by this one rule."""
    if factors is None:
        return x
    return (x.float() * factors[..., None]).to(x.dtype)


def sampled_queries(length: int, count: int = QUERY_SAMPLE) -> Tensor:
    """At most ``count`` query positions of a window of ``length``, evenly spaced over
    1..length-1 (position 0 sees one key and has no entropy to speak of), the last one
    always among them."""
    if length < 2:
        return torch.empty(0, dtype=torch.long)
    if length - 1 <= count:
        return torch.arange(1, length)
    return torch.linspace(1, length - 1, count, dtype=torch.float64).round().long().unique()


@dataclass
class AttentionDiagnostics:
    """The probe's means: ``per_head [layers, heads, len(STATS)]`` over ``queries``
    sampled queries (of every window) per layer."""

    per_head: Tensor
    queries: int

    def summary(self) -> dict[str, float]:
        """Each statistic averaged over layers and heads."""
        means = self.per_head.mean(dim=(0, 1))
        return {stat: float(means[i]) for i, stat in enumerate(STATS)}

    def layers(self) -> dict[str, list[float]]:
        """Each statistic per layer (heads averaged)."""
        means = self.per_head.mean(dim=1)
        return {stat: [float(v) for v in means[:, i]] for i, stat in enumerate(STATS)}

    def heads(self) -> dict[str, list[list[float]]] | None:
        """Each statistic per layer and head; None past MAX_STORED_HEADS heads in all."""
        layers, heads, _ = self.per_head.shape
        if layers * heads > MAX_STORED_HEADS:
            return None
        return {
            stat: [[float(v) for v in row] for row in self.per_head[:, :, i]]
            for i, stat in enumerate(STATS)
        }


class AttentionProbe:
    """Tallies the attention statistics of sampled queries, per layer and head."""

    def __init__(
        self, train_length: int, sample: int = QUERY_SAMPLE, budget: int = QUERY_BUDGET
    ) -> None:
        self.train_length = train_length
        self.sample = sample
        self.budget = budget
        self._sums: dict[int, Tensor] = {}  # layer -> [heads, STATS] float64
        self._counts: dict[int, int] = {}
        self._queries: dict[tuple[int, str], Tensor] = {}
        # What every layer of one forward pass shares (the bias rows of the sampled
        # queries, xPos's block scales), built once for the pass's ``_source``.
        self._source: object = None
        self._memo: dict[tuple, Any] = {}

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
        self._source, self._memo = None, {}

    def _shared(self, source: object, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, once per ``key`` while the layers read the same ``source`` (one
        forward pass's bias or decay); every time without a source."""
        if source is None:
            return build()
        if self._source is not source:
            self._source, self._memo = source, {}
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def queries(self, length: int, device: torch.device) -> Tensor:
        key = (length, str(device))
        if key not in self._queries:
            self._queries[key] = sampled_queries(length, self.sample).to(device)
        return self._queries[key]

    def record(self, layer: int, logits: Tensor, rows: Tensor, reach: Any = None) -> None:
        """Add the attention of queries at positions ``rows [Q]`` whose pre-softmax
        logits over keys 0..K-1 are ``logits [B, H, Q, K]`` (-inf, or MASKED, where
        masked). A few passes over the logits: the softmax by hand, its entropy as
        log(sum e^z') - sum p z' with z' = z - max z (no cancellation when one key
        takes everything), distances by one matrix-vector product."""
        z = logits.float()
        top = z.amax(-1, keepdim=True)
        # Below -80, e^z' (< 2e-35) is negligible beside the largest's 1: clamped there
        # it stays a normal float (exp of a subnormal result is ten times slower) and
        # the masked keys' p z' is 0, not 0 x -inf.
        shifted = (z - top).clamp_(min=-80.0)
        p = shifted.exp()
        total = p.sum(-1, keepdim=True)
        p /= total
        entropy = total.squeeze(-1).log() - torch.linalg.vecdot(p, shifted)
        keys = torch.arange(z.shape[-1], device=z.device, dtype=z.dtype)
        distance = rows.to(z.dtype) - torch.matmul(p, keys)
        beyond = torch.zeros_like(entropy)
        if int(rows.max()) >= self.train_length:
            far = (rows[:, None] - keys[None, :].long()) >= self.train_length  # [Q, K]
            beyond = torch.linalg.vecdot(p, far.to(z.dtype))
        # keys each query sees (``reach``: a layer's window or chunks, worker.attention)
        seen = (rows + 1 if reach is None else reach.keys_seen(rows)).to(z.dtype)
        # A query that sees one key (the first of a chunk) has no spread to normalise: 0.
        normalised = torch.where(seen > 1, entropy / seen.clamp(min=2).log(), 0.0)
        stats = torch.stack(
            (
                entropy,
                normalised,
                distance,
                p[..., :SINK_TOKENS].sum(-1),
                beyond,
                top.squeeze(-1),
            ),
            dim=-1,
        )  # [B, H, Q, STATS]
        tally = stats.double().sum(dim=(0, 2)).cpu()
        if layer in self._sums:
            self._sums[layer] += tally
        else:
            self._sums[layer] = tally
        self._counts[layer] = self._counts.get(layer, 0) + logits.shape[0] * logits.shape[2]

    def windows(self, layer: int, batch: int, per_window: int) -> int:
        """How many of a batch's windows this layer still records: every window until
        ``budget`` queries are recorded (the first windows of a point, the same ones
        whatever else is evaluated)."""
        left = self.budget - self._counts.get(layer, 0)
        return max(0, min(batch, -(-left // max(1, per_window))))

    def result(self) -> AttentionDiagnostics | None:
        """The means so far; None when nothing was recorded."""
        if not self._sums:
            return None
        layers = sorted(self._sums)
        per_head = torch.stack([self._sums[i] / self._counts[i] for i in layers])
        return AttentionDiagnostics(per_head, self._counts[layers[0]])

    def record_sampled(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        *,
        block_rows: int,
        bias_rows: Callable[[int, int], Tensor] | None = None,
        decay: Any = None,
        factors: Tensor | None = None,
        scale: float | None = None,
        source: object = None,
        reach: Any = None,
        terms: Any = None,
    ) -> None:
        """Write out and record the logits of the sampled queries of ``q``, ``k``
        ``[B, H, T, d]`` (q already scaled by ``factors``), block by block of
        ``block_rows`` queries: with ``bias_rows(start, end)`` (the causal bias of
        queries [start, end) over keys [0, end)), scaled by ``factors`` as attention
        scales it, or with xPos's block ``decay``; causal in any case, and the keys a layer's
        ``reach`` hides (a sliding window, chunks) masked too; ``terms`` (a layer's
        ``worker.attention.LogitTerms``) act on them as attention's do: the soft cap
        before the mask, a contextual term (CoPE) after it. The bias and
        the decay are built once per ``source`` (what every layer of a forward pass
        shares: its AttentionBias, its tables), not once per layer."""
        length = q.shape[-2]
        sample = self.queries(length, q.device)
        windows = self.windows(layer, q.shape[0], len(sample))
        if not windows:
            return
        q, k = q[:windows], k[:windows]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        for start in range(0, length, block_rows):
            end = min(length, start + block_rows)
            picked = sample[(sample >= start) & (sample < end)]
            if not len(picked):
                continue
            qb, kb = q[:, :, picked].float(), k[:, :, :end].float()
            key = (start, end, windows)
            if decay is not None:
                q_scale, k_scale = self._shared(
                    source, ("decay", *key), partial(_decay_scales, decay, start, end, windows)
                )
                qb = scale_pairs(qb, q_scale[..., picked - start, :])
                kb = scale_pairs(kb, k_scale)
            logits = torch.matmul(qb, kb.transpose(-1, -2)) * scale
            if bias_rows is not None:
                bias = self._shared(
                    source,
                    ("bias", *key),
                    partial(_sampled_bias, bias_rows, start, end, picked, windows, factors),
                )
                logits = logits + bias
            cap = None if terms is None else terms.cap
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
            keys = torch.arange(end, device=q.device)[None, :]
            if reach is None:
                hidden = keys > picked[:, None]
            else:
                hidden = reach.hidden(picked[:, None], keys)
            logits = logits.masked_fill(hidden, float("-inf"))
            if terms is not None and terms.contextual is not None:
                logits = logits + terms.contextual(qb, logits)
            self.record(layer, logits.masked_fill(hidden, MASKED), picked, reach)


def _decay_scales(decay: Any, start: int, end: int, windows: int) -> tuple[Tensor, Tensor]:
    return tuple(_first(t, windows) for t in decay.scales(start, end))  # type: ignore[return-value]


def _sampled_bias(
    bias_rows: Callable[[int, int], Tensor],
    start: int,
    end: int,
    picked: Tensor,
    windows: int,
    factors: Tensor | None,
) -> Tensor:
    """The bias of the sampled queries ``picked`` of block [start, end): ``[H, Q, end]``,
    or ``[B, 1, Q, end]`` (an hf: model's mask), scaled by their log-n factors."""
    bias = _first(bias_rows(start, end), windows)[..., picked - start, :].float()
    return bias if factors is None else scale_rows(bias, factors[..., picked])


def _first(x: Tensor, windows: int) -> Tensor:
    """The first ``windows`` sequences of a per-sequence ``x [B, ...]`` (4 dims); a
    shared one as it is."""
    return x[:windows] if x.dim() == 4 else x


@dataclass(frozen=True)
class LayerProbe:
    """The probe as one layer's attention sees it."""

    probe: AttentionProbe
    layer: int

    def record(self, q: Tensor, k: Tensor, **options: Any) -> None:
        self.probe.record_sampled(self.layer, q, k, **options)


@contextlib.contextmanager
def attribute_set(owner: object, name: str, value: object) -> Iterator[None]:
    """``owner.name`` set to ``value`` for the duration, then put back. A model without
    the attribute (a stand-in that scores another way) is left alone while ``value`` is
    None; asked for more, it is a ValueError."""
    if not hasattr(owner, name):
        if value is not None:
            raise ValueError(f"{type(owner).__name__} has no {name}: it cannot evaluate this")
        yield
        return
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)
