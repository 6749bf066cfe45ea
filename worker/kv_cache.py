"""The KV cache: every layer's keys and values, and the forward pass that extends them.

A prompt is read in one pass (``prefill``), then one token at a time (``step``). The
engine reuses the model's own modules (embedding, norms, the fused q/k/v projection, the
output projection, the MLP) and the encoding's three hooks, so a decoded token sees
exactly what ``Transformer.forward`` would show it, up to float rounding:

- absolute encodings embed each new token at its position;
- rotary encodings rotate the new queries and keys once, at their positions; the cache
  holds keys as rotated when written (``keep``), or unrotated, and then every step
  rotates all cached keys with the tables of the current length (``rerotate``);
- bias encodings add the bias rows of the new queries over every cached key (the
  encoding's ``bias(q_len, k_len)`` for the last q_len of k_len positions);
- xPos's decay zeta^((n - m) / scale_base) is applied per block of queries, centred on
  the block's last query, as ``decayed_attention`` does past one table's span: keys are
  cached plainly rotated and scaled afresh at each step.

Positions are drawn for the whole sequence when the cache is made (randomized
positions: one sorted draw for the final length, used step by step).

The two cache policies differ only where the rotary frequencies depend on the length
(dynamic NTK, LongRoPE): ``keep`` is what HF transformers and vLLM do (a key keeps the
frequencies of the length at which it was written); ``rerotate`` is exact, the one-pass
forward at every length: while the frequencies stay those of the cached tokens the
cache is used as it is (keys stored unrotated, rotated with the current tables), and
when a new token changes them (past the original length) the cache is rebuilt by
reading every token so far in one pass - rotating the cached keys alone would not do,
since deeper layers' keys and values come from hidden states computed under the old
frequencies. Exactness costs a pass over the sequence per step past the original
length; a window cannot be rebuilt (its dropped keys are gone), so ``rerotate`` takes
none.

A ``window`` of W keys with ``sinks`` S (StreamingLLM, Xiao et al. 2023): before new
tokens are written, the cache drops the keys between its first S and its most recent
ones, so that every query attends to at most W keys: the S first tokens and the most
recent W - S (itself included). Kept keys keep the positions they were written at (a
rotary key its rotation, a bias its true distance): positions are never renumbered, so
past the training length the distances seen are those of the full sequence, and a
window tests locality rather than bringing distances back in range. This window is the
evaluation's (how much the cache keeps); a model trained with a sliding window (every
encoding's ``window`` parameter) masks the keys past its layers' own windows by their
true distance here too, as its one-pass forward does.

The cache reads whatever tokens it is given; which ones, and what becomes of the logits
(teacher forcing, greedy generation, the ``decode`` protocol's scores and timing), is
``worker.decode``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.attention import LogitTerms, additive_mask, written_out_biased_attention
from worker.diagnostics import logn_factors, scale_rows
from worker.encodings.base import PositionEncoding
from worker.encodings.layered import Layered
from worker.encodings.rope import Rope
from worker.encodings.rotary import BlockDecay, RotaryTables, rotated, scale_pairs
from worker.encodings.xpos import XPos
from worker.model import Transformer
from worker.reach import CAUSAL, Reach

CachePolicy = Literal["keep", "rerotate"]
CACHE_POLICIES: tuple[str, ...] = ("keep", "rerotate")
# Query rows per attention block in a prefill: bounds the scores held at once.
PREFILL_BLOCK_ROWS = 256


def kv_cache_bytes(model: Transformer, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values a cache holds per sequence for ``tokens`` kept tokens:
    2 x layers x heads x head_dim x tokens x bytes per value."""
    cfg = model.config
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * tokens * size


@dataclass
class KVCache:
    """Keys and values of every layer, ``[B, H, capacity, head_dim]``, preallocated; slot s
    holds token ``index[s]``; the first ``length`` slots are live."""

    encoding: PositionEncoding
    positions: Tensor  # [T] or [B, T]: the encoding's positions of every token to come
    policy: CachePolicy
    window: int | None
    sinks: int
    keys: list[Tensor]
    values: list[Tensor]
    index: Tensor  # [capacity] int64
    history: Tensor  # [B, T] the tokens written so far (rerotate rebuilds from them)
    length: int = 0
    written: int = 0  # tokens seen so far (the next token's index)
    evicted: int = 0  # keys dropped by the window so far

    @property
    def total(self) -> int:
        return self.positions.shape[-1]

    @property
    def capacity(self) -> int:
        return self.index.shape[0]

    def nbytes(self) -> int:
        """Bytes of the live keys and values of one sequence."""
        batch = self.keys[0].shape[0]
        live = sum(t[:, :, : self.length].nbytes for t in (*self.keys, *self.values))
        return live // batch


def new_cache(
    model: Transformer,
    batch_size: int,
    total_length: int,
    *,
    policy: str = "keep",
    window: int | None = None,
    sinks: int = 0,
    dtype: torch.dtype = torch.float32,
) -> KVCache:
    """An empty cache for ``batch_size`` sequences of up to ``total_length`` tokens, with
    the encoding's positions drawn for that length now."""
    if policy not in CACHE_POLICIES:
        raise ValueError(f"cache_policy must be one of {', '.join(CACHE_POLICIES)}, got {policy!r}")
    for name, value, low in (("batch_size", batch_size, 1), ("total_length", total_length, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer (keys kept), got {window!r}")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or not 0 <= sinks < window:
            raise ValueError(f"sinks must be an integer in [0, window={window}), got {sinks!r}")
    elif sinks:
        raise ValueError("sinks need a window: sinks are the first keys a window always keeps")
    if window is not None and policy == "rerotate":
        raise ValueError(
            "cache_policy 'rerotate' rebuilds the cache from every token when the "
            "frequencies change; a window has dropped some: use 'keep' with a window"
        )
    device = model.token_embedding.weight.device
    encoding = model.encoding
    positions = encoding.positions(batch_size, total_length, device)
    capacity = min(window, total_length) if window is not None else total_length
    cfg = model.config
    shape = (batch_size, cfg.n_heads, capacity, cfg.head_dim)
    return KVCache(
        encoding=encoding,
        positions=positions,
        policy=policy,  # type: ignore[arg-type]
        window=window,
        sinks=sinks,
        keys=[torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)],
        values=[torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)],
        index=torch.zeros(capacity, dtype=torch.long, device=device),
        history=torch.zeros(batch_size, total_length, dtype=torch.long, device=device),
    )


def _evict(cache: KVCache, incoming: int) -> None:
    """Make room for ``incoming`` tokens within the window: keep the sinks and the most
    recent keys."""
    if cache.window is None or cache.length + incoming <= cache.window:
        return
    recent = cache.window - incoming - cache.sinks
    if recent < 0:
        raise ValueError(
            f"{incoming} new tokens do not fit a window of {cache.window} keys with "
            f"{cache.sinks} sinks; write at most {cache.window - cache.sinks} at a time"
        )
    keep = torch.cat(
        (
            torch.arange(cache.sinks),
            torch.arange(cache.length - recent, cache.length),
        )
    ).to(cache.index.device)
    for store in (*cache.keys, *cache.values):
        store[:, :, : keep.numel()] = store[:, :, keep].clone()
    cache.index[: keep.numel()] = cache.index[keep].clone()
    cache.evicted += cache.length - keep.numel()
    cache.length = keep.numel()


@dataclass(frozen=True)
class _Step:
    """What every layer shares in one call: the new tokens' slots and their rotations."""

    start: int  # slot of the first new token
    count: int  # new tokens
    query_index: Tensor  # [n] token indices of the new tokens
    key_index: Tensor  # [K] token indices of every live key, new ones included
    # Per kind of layer (one, or a recipe's): the new tokens' rotations, and under
    # rerotate the rotations of every live key.
    query_tables: list[RotaryTables | None]
    key_tables: list[RotaryTables | None]
    decay: BlockDecay | None  # xPos: over the live keys' positions
    # Bias and mask of each block of queries (and reach), built by the first
    # layer with it, read by the rest;
    # so are xPos's decay scales of each block (a power per key and rotated pair).
    masks: dict[tuple[int, int, Reach], Tensor | None] = field(default_factory=dict)
    scales: dict[tuple[int, int], tuple[Tensor, Tensor]] = field(default_factory=dict)


def _plain_tables(encoding: PositionEncoding, positions: Tensor) -> RotaryTables | None:
    """Rotation tables without xPos's scales (its decay is applied per block)."""
    if isinstance(encoding, XPos):
        return Rope.rotary_tables(encoding, positions)
    return encoding.rotary_tables(positions)


def _kinds(encoding: PositionEncoding) -> list[PositionEncoding]:
    """The encoding of each kind of layer: a recipe's kinds, or the one encoding."""
    return list(encoding.kinds) if isinstance(encoding, Layered) else [encoding]


def _prepare(cache: KVCache, count: int) -> _Step:
    if cache.written + count > cache.total:
        raise ValueError(
            f"the cache was made for {cache.total} tokens; {cache.written} are written "
            f"and {count} more do not fit"
        )
    _evict(cache, count)
    start, device = cache.length, cache.index.device
    new = torch.arange(cache.written, cache.written + count, device=device)
    cache.index[start : start + count] = new
    key_index = cache.index[: start + count]
    enc, positions = cache.encoding, cache.positions
    query_tables: list[RotaryTables | None] = []
    key_tables: list[RotaryTables | None] = []
    for kind in _kinds(enc):
        if cache.policy == "rerotate":
            every_key = _plain_tables(kind, positions[..., key_index])
            key_tables.append(every_key)
            sliced = None if every_key is None else _slice_tables(every_key, start, start + count)
            query_tables.append(sliced)
        else:
            key_tables.append(None)
            query_tables.append(_plain_tables(kind, positions[..., new]))
    decay = None
    if isinstance(enc, XPos):
        decay = BlockDecay(enc.zeta, enc.scale_base, positions[..., key_index], enc.table_span // 2)
    return _Step(start, count, new, key_index, query_tables, key_tables, decay)


def _slice_tables(tables: RotaryTables, start: int, end: int) -> RotaryTables:
    def cut(t: Tensor) -> Tensor:
        return t[..., start:end, :]

    return RotaryTables(cut(tables.cos_q), cut(tables.sin_q), cut(tables.cos_k), cut(tables.sin_k))


def _attend(
    cache: KVCache,
    layer: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    step: _Step,
    factors: Tensor | None = None,
    reach: Reach = CAUSAL,
    kind: int = 0,
    terms: LogitTerms | None = None,
) -> Tensor:
    """Write the new k, v into the cache and attend the new queries over every live key
    (each query's logits multiplied by its log-n ``factors``, when given) that the
    layer's ``reach`` (its trained sliding window, its chunks) shows them; ``kind``: the
    layer's kind (a recipe's), whose rotations apply."""
    end = step.start + step.count
    query_tables, key_tables = step.query_tables[kind], step.key_tables[kind]
    if query_tables is not None:
        t = query_tables
        q = rotated(q, t.cos_q, t.sin_q)
        if key_tables is None:
            k = rotated(k, t.cos_k, t.sin_k)
    cache.keys[layer][:, :, step.start : end] = k
    cache.values[layer][:, :, step.start : end] = v
    keys, values = cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end]
    if key_tables is not None:
        keys = rotated(keys, key_tables.cos_k, key_tables.sin_k)
    # Attention runs in the cache's dtype (a bf16 cache: bf16 scores, as in serving).
    q, enc = scale_rows(q, factors).to(keys.dtype), cache.encoding
    blocks = []
    rows = step.count if step.decay is None else min(step.count, step.decay.max_rows)
    rows = min(rows, PREFILL_BLOCK_ROWS)
    for first in range(0, step.count, rows):
        last = min(step.count, first + rows)
        visible = step.start + last  # keys past the block's last query are all future
        q_block, k_block = q[:, :, first:last], keys[:, :, :visible]
        if step.decay is not None:
            if (first, last) not in step.scales:
                step.scales[first, last] = step.decay.scales(step.start + first, visible)
            q_scale, k_scale = step.scales[first, last]
            q_block, k_block = scale_pairs(q_block, q_scale), scale_pairs(k_block, k_scale)
        if (first, last, reach) not in step.masks:
            step.masks[first, last, reach] = _mask(enc, step, first, last, visible, q.dtype, reach)
        mask = step.masks[first, last, reach]
        if factors is not None and mask is not None and mask.dtype != torch.bool:
            mask = scale_rows(mask, factors[..., first:last])
        if terms is not None:  # written out: SDPA has no cap, no contextual term
            additive = q_block.new_zeros(q_block.shape[-2], visible) if mask is None else mask
            if additive.dtype == torch.bool:
                additive = additive_mask(additive, q_block.dtype)
            blocks.append(
                written_out_biased_attention(
                    q_block, k_block, values[:, :, :visible], additive, terms
                )
            )
            continue
        blocks.append(
            F.scaled_dot_product_attention(q_block, k_block, values[:, :, :visible], attn_mask=mask)
        )
    return torch.cat(blocks, dim=2).to(v.dtype)


def _mask(
    enc: PositionEncoding,
    step: _Step,
    first: int,
    last: int,
    visible: int,
    dtype: torch.dtype,
    reach: Reach = CAUSAL,
) -> Tensor | None:
    """The additive bias and causal mask of queries [first, last) of this call over the
    first ``visible`` live keys, the keys the layer's ``reach`` hides masked too (None
    when every key is visible and there is no bias)."""
    queries = step.query_index[first:last]
    keys = step.key_index[:visible]
    # Token indices: true distances and chunks, whatever the cache evicted.
    future = reach.hidden(queries[:, None], keys[None, :])
    if not enc.has_bias:
        return None if not bool(future.any()) else ~future
    k_len = int(queries[-1]) + 1
    bias = enc.bias(last - first, k_len)
    assert bias is not None
    if keys.numel() != k_len:  # evicted keys: the bias of the kept ones only
        bias = bias[:, :, keys]
    return bias.masked_fill(future, float("-inf")).to(dtype).unsqueeze(0)


def _frequencies_change(cache: KVCache, count: int) -> bool:
    """Whether ``count`` new tokens change the rotary frequencies of the cached ones (a
    scaling that follows the length, past its original length)."""
    if not cache.written:
        return False
    positions = cache.positions
    before = int(positions[..., : cache.written].max()) + 1
    after = int(positions[..., : cache.written + count].max()) + 1
    for enc in _kinds(cache.encoding):
        scaling = getattr(enc, "scaling", None)
        if scaling is None or not scaling.follows_length:
            continue
        if not torch.equal(enc.frequencies(before), enc.frequencies(after)):
            return True
    return False


@torch.no_grad()
def forward_cached(model: Transformer, tokens: Tensor, cache: KVCache) -> Tensor:
    """Logits ``[B, n, vocab]`` of ``tokens [B, n]``, the next n tokens of the sequences
    in ``cache``, which then holds their keys and values too."""
    if model.encoding is not cache.encoding:
        raise ValueError("the cache was made for another encoding (a scaling entered or left)")
    count = tokens.shape[1]
    if cache.policy == "rerotate" and _frequencies_change(cache, count):
        # Exact: every token so far read again under the new length's frequencies.
        replay = torch.cat((cache.history[:, : cache.written], tokens), dim=1)
        cache.length = cache.written = 0
        return _forward(model, replay, cache)[:, -count:]
    return _forward(model, tokens, cache)


def _forward(model: Transformer, tokens: Tensor, cache: KVCache) -> Tensor:
    batch, count = tokens.shape
    step = _prepare(cache, count)
    cache.history[:, cache.written : cache.written + count] = tokens
    positions = cache.positions[..., step.query_index]
    x = model.token_embedding(tokens) * math.sqrt(model.config.d_model)
    x = cache.encoding.embed(x, positions)
    heads = model.config.n_heads
    factors = None
    if model.logn_length is not None:  # the new queries' positions: written..written+count-1
        end = cache.written + count
        factors = logn_factors(end, model.logn_length, tokens.device, start=cache.written)
    kinds = len(step.query_tables)
    every_factors = [model.kind_factors(kind, positions, factors) for kind in range(kinds)]
    for layer, (block, kind) in enumerate(zip(model.blocks, model.layer_kinds, strict=True)):
        attn = block.attn
        qkv = attn.qkv(block.attn_norm(x))
        q, k, v = qkv.view(batch, count, 3, heads, -1).permute(2, 0, 3, 1, 4)
        layer_factors = model.layer_factors(layer, positions, every_factors[kind])
        y = _attend(cache, layer, q, k, v, step, layer_factors, attn.reach, kind, attn.terms)
        x = x + attn.proj(y.transpose(1, 2).reshape(batch, count, -1))
        x = x + block.mlp(block.mlp_norm(x))
    cache.length = step.start + count
    cache.written += count
    x = model.final_norm(x)
    # The tied head in float32 even under autocast, as in Transformer.forward.
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), model.token_embedding.weight.float())


def prefill(model: Transformer, tokens: Tensor, cache: KVCache) -> Tensor:
    """Logits of a prompt ``[B, P]`` read in one pass (with a window: its first window
    tokens in one pass, the rest one at a time, so no query sees more than the window)."""
    if cache.window is None or tokens.shape[1] <= cache.window:
        return forward_cached(model, tokens, cache)
    head = forward_cached(model, tokens[:, : cache.window], cache)
    rest = [
        forward_cached(model, tokens[:, t : t + 1], cache)
        for t in range(cache.window, tokens.shape[1])
    ]
    return torch.cat((head, *rest), dim=1)


def step(model: Transformer, tokens: Tensor, cache: KVCache) -> Tensor:
    """Logits ``[B, vocab]`` of one new token per sequence (``tokens [B]``)."""
    return forward_cached(model, tokens[:, None], cache)[:, 0]
