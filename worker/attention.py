"""Which attention kernel runs, and the fused one for encodings that act on the logits.

Four implementations, named as HF transformers names them (``attn_implementation``):

- ``eager``: the scores written out, softmax, then the values, in blocks of query rows
  (the reference every other path is held to);
- ``sdpa``: ``scaled_dot_product_attention``; flash on a GPU where no bias is needed,
  an additive mask per block of query rows where one is (ALiBi, T5, KERPLE, FIRE);
- ``flex_attention``: PyTorch's compiled fused kernel (``torch.nn.attention.flex_attention``)
  with the encoding's bias as a ``score_mod`` and the causal mask (and a sliding window)
  as a block mask: no bias matrix, fully masked tiles skipped;
- ``auto``: flex on CUDA for an encoding with a bias or a sliding window, sdpa otherwise
  (on the CPU a learned bias in training is written out, where SDPA's CPU kernel would
  materialise every score anyway).

A sliding window (every encoding's ``window`` parameter) and Llama 4's chunks are part of
the causal mask on every path (``Reach``): a block of queries reads only the keys it can
reach (``Reach.first_key``).

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

import torch
import torch.nn.functional as F
from torch import Tensor

from core.catalog.models import ATTN_IMPLEMENTATIONS
from worker.encodings.base import PositionEncoding, causal_toeplitz
from worker.encodings.rotary import BlockDecay, scale_pairs
from worker.fused import FLEX_AVAILABLE
from worker.reach import CAUSAL, Reach

log = logging.getLogger("posbench.attention")


def check_implementation(requested: str) -> None:
    """ValueError for a name that is none of ATTN_IMPLEMENTATIONS."""
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, "
            f"got {requested!r}"
        )


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
    windowed: bool = False,
    softcap: bool = False,
    contextual: bool = False,
) -> Choice:
    """The implementation a pass runs with: ``requested`` (auto, eager, sdpa,
    flex_attention) for an encoding with an additive bias (``has_bias``; ``learned``: with
    parameters of its own) that has a fused form (``fusable``), on ``device``, with or
    without a ``backward`` to follow; ``decay``: xPos's per-block decay is in use;
    ``windowed``: a layer attends through a sliding window or chunks (flex skips the
    tiles outside them where SDPA masks them); ``softcap``: the logits are soft-capped,
    which SDPA cannot do (written out, or flex's score_mod); ``contextual``: a term of the
    scores themselves is added (CoPE), which neither fused kernel can do (written out)."""
    check_implementation(requested)
    choice = _choose(
        requested,
        device=device,
        has_bias=has_bias,
        fusable=fusable,
        backward=backward,
        learned=learned,
        decay=decay,
        windowed=windowed,
        softcap=softcap,
    )
    if contextual and choice.implementation != "eager":
        why = choice.note or f"{choice.implementation} was chosen"
        return Choice(
            "eager", f"a contextual logit term (CoPE) has no fused form: written out ({why})"
        )
    if softcap and not decay and choice.implementation == "sdpa":
        # xPos's block decay writes capped logits out itself; elsewhere SDPA has no cap.
        why = choice.note or f"{requested} was asked"
        return Choice("eager", f"soft-capped logits have no SDPA form: written out ({why})")
    return choice


def _choose(
    requested: str,
    *,
    device: torch.device,
    has_bias: bool,
    fusable: bool,
    backward: bool,
    learned: bool,
    decay: bool,
    windowed: bool,
    softcap: bool,
) -> Choice:
    if decay:
        note = None
        if requested in ("eager", "flex_attention"):
            note = (
                f"xpos past one table's span runs on sdpa, not {requested}: its decay "
                "overflows a score_mod and is applied per block of queries"
            )
        return Choice("sdpa", note)
    if requested == "auto":
        fits_flex = fusable or not has_bias  # a bias, if any, has a score_mod
        wanted = has_bias or windowed or softcap
        if device.type == "cuda" and wanted and fits_flex and FLEX_AVAILABLE:
            return Choice("flex_attention")
        if softcap:
            return Choice("eager")
        if device.type == "cpu" and has_bias and learned and backward:
            # PyTorch's fused CPU kernel writes every score out with a learned bias and is
            # slower than doing it ourselves (``written_out``, below).
            return Choice("eager")
        return Choice("sdpa")
    if requested != "flex_attention":
        return Choice(requested)
    if not FLEX_AVAILABLE:
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


# -- the block paths (eager and sdpa) -------------------------------------------------------


# Memory bounds of attention with a bias, in elements. The bias matrix itself
# ([heads, T, T]) is built once per forward pass and shared by every layer while
# it fits MASK_BUDGET; past it, each query block builds its own rows. Each query
# block materialises at most SCORE_BUDGET scores (batch x heads x rows x keys).
MASK_BUDGET = 1 << 24
SCORE_BUDGET = 1 << 22
# Query rows per block. Smaller blocks skip more of the causal upper triangle but
# run smaller matmuls. The fused kernel tiles internally and wants long blocks; the
# written-out path (a learned bias in CPU training) is fastest at 128 rows: at T=256
# two blocks do 3/4 of the square's work (KERPLE-log training step, this model, 25
# interleaved rounds: 221 ms with 128-row blocks against 233 ms with 256).
MAX_BLOCK_ROWS = 256
WRITTEN_OUT_BLOCK_ROWS = 128


class AttentionBias:
    """An encoding's bias plus the causal mask, for one forward pass.

    Attention with a bias runs in blocks of query rows: block [s, e) needs keys
    [0, e) only, so the causal upper triangle is mostly skipped, and evaluation at
    long lengths never holds heads x T^2 scores. The rows come from a matrix built
    once and shared by the layers when it fits, otherwise from the encoding's
    per-distance values (Toeplitz encodings: ALiBi, T5, KERPLE) or its ``bias``.
    """

    def __init__(
        self,
        encoding: PositionEncoding,
        length: int,
        batch_size: int,
        dtype: torch.dtype,
        device: torch.device,
        budget: int = SCORE_BUDGET,
        causal: bool = True,
        written: bool | None = None,
    ) -> None:
        self.encoding = encoding
        self.causal = causal
        self.dtype = dtype
        self.device = device
        per_row = batch_size * encoding.n_heads * length
        if written is None:
            learned = torch.is_grad_enabled() and any(
                p.requires_grad for p in encoding.parameters()
            )
            written = written_out(device, learned)
        # Whether each block's scores are written out (eager) or go through SDPA.
        self.written = written
        longest = WRITTEN_OUT_BLOCK_ROWS if written else MAX_BLOCK_ROWS
        self.block_rows = max(1, min(length, longest, budget // per_row))
        by_distance = getattr(encoding, "distance_bias", None) if causal else None
        self.by_distance = by_distance(length) if by_distance is not None else None
        fits = encoding.n_heads * length * length <= MASK_BUDGET
        self.full = self._build(0, length) if fits or not causal else None

    def _build(self, start: int, end: int) -> Tensor:
        if self.by_distance is not None:
            return causal_toeplitz(self.by_distance.to(self.dtype), start, end)
        bias = self.encoding.bias(end - start, end)
        assert bias is not None, "AttentionBias needs an encoding with a bias"
        if self.causal:
            future = torch.ones(end - start, end, dtype=torch.bool, device=self.device)
            bias = bias.masked_fill(future.triu(diagonal=start + 1), float("-inf"))
        return bias.to(self.dtype)

    def rows(self, start: int, end: int) -> Tensor:
        """``[heads, end-start, end]``: bias for queries start..end-1 over keys 0..end-1."""
        if self.full is not None:
            return self.full[:, start:end, :end]
        return self._build(start, end)


def written_out(device: torch.device, bias_needs_grad: bool) -> bool:
    """Whether attention with a bias takes the written-out path: on the CPU when the
    bias needs a gradient (T5, KERPLE and FIRE in training), where PyTorch's fused CPU
    kernel falls back to materialising every score. A fixed bias (ALiBi), every
    evaluation and every GPU keep the fused kernel, which holds a tile of scores at
    a time (ALiBi training step: 176 ms fused against 187 ms written out)."""
    return device.type == "cpu" and bias_needs_grad


def fused_biased_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) v through SDPA's fused kernel; ``bias`` is
    ``[heads, queries, keys]``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))


def additive_mask(seen: Tensor, dtype: torch.dtype) -> Tensor:
    """Booleans (True: attend) as an additive mask of ``dtype``: 0 where a key is seen,
    -inf where it is hidden, for the paths that add a mask to written-out scores."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(
        ~seen, float("-inf")
    )


@dataclass(frozen=True)
class LogitTerms:
    """What a layer does to its logits beyond q.k / sqrt(d) + bias, which SDPA cannot do,
    so the scores are written out wherever a layer has any: Gemma 2's soft ``cap``, and a
    ``contextual`` term that depends on the masked scores themselves (CoPE's positions
    counted by gates; x-transformers adds it after the mask), called with the unscaled
    queries ``[..., Q, d]`` and the masked logits ``[..., Q, K]``."""

    cap: float | None = None
    contextual: Callable[[Tensor, Tensor], Tensor] | None = None

    def apply(self, q: Tensor, scores: Tensor) -> Tensor:
        """``scores`` (biased, masked with -inf) capped, then the contextual term added;
        a hidden score stays hidden."""
        scores = softcapped(scores, self.cap)
        if self.contextual is not None:
            scores = scores + self.contextual(q, scores)
        return scores


def softcapped(scores: Tensor, cap: float | None) -> Tensor:
    """cap x tanh(scores / cap), Gemma 2's attention logit soft-capping, on the logits
    with their bias; a hidden (-inf) score stays hidden. ``cap`` None: unchanged."""
    if cap is None:
        return scores
    capped = torch.tanh(scores / cap) * cap
    return capped.masked_fill(scores == float("-inf"), float("-inf"))


def written_out_biased_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, terms: LogitTerms | None = None
) -> Tensor:
    """The same in three ops. q is scaled before the product (queries x head_dim
    multiplies instead of queries x keys) and the bias added in place into the
    fresh score tensor, which saves a pass and an allocation per block; ``terms``
    act on the biased, masked logits (``LogitTerms.apply``)."""
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    scores.add_(bias)
    if terms is not None:
        scores = terms.apply(q, scores)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def biased_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    written: bool | None = None,
    terms: LogitTerms | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) v for ``bias`` of shape [heads, queries, keys],
    written out or through SDPA (``written``; None: whichever ``written_out`` picks);
    soft-capped logits are always written out (SDPA has no cap)."""
    if written is None:
        written = written_out(q.device, bias.requires_grad)
    if written or terms is not None:
        return written_out_biased_attention(q, k, v, bias, terms)
    return fused_biased_attention(q, k, v, bias)


# -- the causal mask, a sliding window and chunks (worker.reach) --------------------------


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    written: bool,
    reach: Reach = CAUSAL,
    terms: LogitTerms | None = None,
) -> Tensor:
    """Causal attention without a bias: SDPA's causal kernel (flash on a GPU) when every
    earlier key is visible and the scores need not be written out; otherwise in blocks of
    query rows, block [s, e) over keys [reach.first_key(s), e) under its mask, written
    out (``eager``; always with ``terms``) or through SDPA."""
    written = written or terms is not None
    if not reach.limited and not written:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    length = q.shape[-2]
    rows = WRITTEN_OUT_BLOCK_ROWS if written else MAX_BLOCK_ROWS
    blocks = []
    for start in range(0, length, rows):
        end = min(length, start + rows)
        lo = reach.first_key(start)
        seen = reach.visible(start, end, q.device)
        q_block, k_block, v_block = q[:, :, start:end], k[:, :, lo:end], v[:, :, lo:end]
        if written:
            mask = additive_mask(seen, q.dtype)
            blocks.append(written_out_biased_attention(q_block, k_block, v_block, mask, terms))
        else:
            blocks.append(F.scaled_dot_product_attention(q_block, k_block, v_block, attn_mask=seen))
    return torch.cat(blocks, dim=2)


def written_out_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, terms: LogitTerms | None = None
) -> Tensor:
    """Attention without a bias, the scores written out (``eager``): causal in blocks of
    query rows (block [s, e) needs keys [0, e) only), or both ways at once."""
    if causal:
        return causal_attention(q, k, v, written=True, terms=terms)
    length = q.shape[-2]
    return written_out_biased_attention(q, k, v, q.new_zeros(1, length, length), terms)


def reached_bias(bias: Tensor, start: int, end: int, reach: Reach) -> Tensor:
    """Causal bias rows of queries [start, end) over keys [0, end) (``AttentionBias.rows``)
    cut to the keys the block reads under ``reach``, the keys it hides masked."""
    if not reach.limited:
        return bias
    seen = reach.visible(start, end, bias.device)
    return bias[..., reach.first_key(start) :].masked_fill(~seen, float("-inf"))


def decayed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: BlockDecay,
    reach: Reach = CAUSAL,
    terms: LogitTerms | None = None,
) -> Tensor:
    """Causal attention of rotated q, k with xPos's decay applied per block of queries
    (``BlockDecay``): block [s, e) attends keys [reach.first_key(s), e) under its mask."""
    length = q.shape[-2]
    blocks = []
    for start in range(0, length, decay.max_rows):
        end = min(length, start + decay.max_rows)
        lo = reach.first_key(start)
        query_scale, key_scale = decay.scales(start, end)
        q_block = scale_pairs(q[:, :, start:end], query_scale)
        k_block = scale_pairs(k[:, :, lo:end], key_scale[..., lo:, :])
        seen = reach.visible(start, end, q.device)
        if terms is not None:  # written out: SDPA has no cap, no contextual term
            mask = additive_mask(seen, q.dtype)
            blocks.append(
                written_out_biased_attention(q_block, k_block, v[:, :, lo:end], mask, terms)
            )
            continue
        blocks.append(
            F.scaled_dot_product_attention(q_block, k_block, v[:, :, lo:end], attn_mask=seen)
        )
    return torch.cat(blocks, dim=2)
