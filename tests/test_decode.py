"""KV-cache decoding (worker/kv_cache.py, driven by worker/decode.py) against the one-pass
forward it must reproduce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.catalog.encodings import REGISTRY, SCALINGS
from worker.data.synthetic import Passkey
from worker.decode import decode_logits, greedy
from worker.kv_cache import forward_cached, kv_cache_bytes, new_cache, prefill, step
from worker.layers import ModelConfig
from worker.model import Transformer, build_model

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2)
ONE_LAYER = ModelConfig(d_model=32, n_layers=1, n_heads=2)
TRAIN = 32
PROMPT = 5
TOLERANCE = 1e-5


def _losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


def _max_loss_gap(model: Transformer, tokens: torch.Tensor, **options: object) -> float:
    """Per-token losses of prefill + step-by-step decoding against one forward pass
    (the same seed before each: randomized positions are drawn the same)."""
    torch.manual_seed(11)
    with torch.no_grad():
        reference = _losses(model(tokens), tokens)
    torch.manual_seed(11)
    decoded = _losses(decode_logits(model, tokens, PROMPT, **options), tokens)
    return float((reference - decoded).abs().max())


def _lengths(encoding: str) -> tuple[int, ...]:
    # Across the training length, and past it where the encoding has positions there.
    return (TRAIN,) if REGISTRY[encoding].bounded_by_train_length else (TRAIN, 3 * TRAIN)


@pytest.mark.parametrize("encoding", sorted(REGISTRY))
def test_decoded_losses_equal_the_forward_for_every_encoding(encoding: str) -> None:
    model = build_model(TINY, encoding, train_length=TRAIN).eval()
    for length in _lengths(encoding):
        tokens = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(3))
        assert _max_loss_gap(model, tokens) < TOLERANCE, (encoding, length)


def test_xpos_decay_past_one_table_span_decodes_exactly() -> None:
    # A short scale_base makes the forward apply xPos's decay block by block (BlockDecay)
    # at this length; decoding applies it per step.
    model = build_model(TINY, "xpos", train_length=TRAIN, scale_base=2.0).eval()
    length = model.encoding.table_span + 40
    tokens = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(4))
    assert _max_loss_gap(model, tokens) < TOLERANCE


def _rope_model(config: ModelConfig = TINY) -> Transformer:
    return build_model(config, "rope", train_length=TRAIN).eval()


def _scaled(model: Transformer, method: str):
    return model.scaled(method, 4.0 if SCALINGS[method].needs_factor else None)


def _follows_length(model: Transformer, method: str) -> bool:
    with _scaled(model, method) as scaled:
        return scaled.encoding.scaling.follows_length


STATIC = [m for m in sorted(SCALINGS) if not _follows_length(_rope_model(), m)]
DYNAMIC = [m for m in sorted(SCALINGS) if _follows_length(_rope_model(), m)]


def test_the_scalings_split_into_static_and_length_dependent_ones() -> None:
    assert STATIC and DYNAMIC and len(STATIC) + len(DYNAMIC) == len(SCALINGS)


@pytest.mark.parametrize("method", STATIC)
def test_decoded_losses_equal_the_forward_under_static_scalings(method: str) -> None:
    model = _rope_model()
    tokens = torch.randint(0, 256, (2, 3 * TRAIN), generator=torch.Generator().manual_seed(5))
    with _scaled(model, method) as scaled:
        for policy in ("keep", "rerotate"):
            assert _max_loss_gap(scaled, tokens, policy=policy) < TOLERANCE, policy


@pytest.mark.parametrize("layers", ["one", "two"])
@pytest.mark.parametrize("method", DYNAMIC)
def test_length_dependent_scalings_keep_and_rerotate(method: str, layers: str) -> None:
    # rerotate is exact in every layer: past the original length the cache is rebuilt.
    model = _rope_model(ONE_LAYER) if layers == "one" else _rope_model()
    length = 2 * TRAIN
    tokens = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(6))
    with _scaled(model, method) as scaled:
        kept = decode_logits(scaled, tokens, PROMPT, policy="keep")
        rerotated = decode_logits(scaled, tokens, PROMPT, policy="rerotate")
        with torch.no_grad():
            one_pass = scaled(tokens)
            at_train = scaled(tokens[:, :TRAIN])
    # Up to the training length the frequencies are the trained ones: both policies,
    # and the forward at that length, agree.
    assert (kept[:, :TRAIN] - rerotated[:, :TRAIN]).abs().max() < TOLERANCE
    assert (kept[:, :TRAIN] - at_train).abs().max() < TOLERANCE
    # Past it, keys kept with the rotation they were written with differ...
    assert (kept[:, -1] - rerotated[:, -1]).abs().max() > 1e-3
    # ... and rerotated keys give the one-pass result at the last position.
    assert (rerotated[:, -1] - one_pass[:, -1]).abs().max() < TOLERANCE


def test_kv_cache_bytes_are_two_x_layers_heads_head_dim_tokens_value_bytes() -> None:
    model = _rope_model()
    cfg = model.config
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(7))
    for dtype, value_bytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        cache = new_cache(model, 3, 20, dtype=dtype)
        for written in (8, 9, 10):
            if written == 8:
                prefill(model, tokens[:, :8], cache)
            else:
                step(model, tokens[:, written - 1], cache)
            expected = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * written * value_bytes
            assert cache.nbytes() == expected == kv_cache_bytes(model, written, dtype)
    windowed = new_cache(model, 1, 20, window=6, sinks=2)
    decode_logits(model, tokens[:1], PROMPT, cache=windowed)
    assert windowed.length == 6 and windowed.evicted == 14
    assert windowed.nbytes() == kv_cache_bytes(model, 6, torch.float32)


def test_a_window_attends_the_sinks_and_the_most_recent_keys() -> None:
    # One layer without positions: the last token's logits under a window of W keys
    # with S sinks are those of a forward over exactly those keys' tokens.
    model = build_model(ONE_LAYER, "nope", train_length=TRAIN).eval()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(8))
    window, sinks = 10, 3
    logits = decode_logits(model, tokens, PROMPT, window=window, sinks=sinks)
    kept = torch.cat((tokens[:, :sinks], tokens[:, -(window - sinks) :]), dim=1)
    with torch.no_grad():
        expected = model(kept)[:, -1]
    assert (logits[:, -1] - expected).abs().max() < TOLERANCE
    # A window as long as the sequence changes nothing.
    unbounded = decode_logits(model, tokens, PROMPT)
    assert (decode_logits(model, tokens, PROMPT, window=40) - unbounded).abs().max() < TOLERANCE
    assert (logits[:, -1] - unbounded[:, -1]).abs().max() > 1e-3


def _last_query_by_hand(
    model: Transformer, tokens: torch.Tensor, kept: torch.Tensor
) -> torch.Tensor:
    """A one-layer model's logits for the last token attending only to the ``kept`` keys
    (token indices), written out from the encoding's hooks: embed, rotate, bias."""
    length = tokens.shape[1]
    enc, block = model.encoding, model.blocks[0]
    positions = enc.positions(tokens.shape[0], length, tokens.device)
    x = enc.embed(model.token_embedding(tokens) * model.config.d_model**0.5, positions)
    qkv = block.attn.qkv(block.attn_norm(x))
    q, k, v = qkv.view(*tokens.shape, 3, model.config.n_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = enc.rotate(q, k, positions)
    scores = q[:, :, -1:] @ k[:, :, kept].transpose(-1, -2) / q.shape[-1] ** 0.5
    bias = enc.bias(length, length)
    if bias is not None:
        scores = scores + bias[:, -1:, kept]
    y = (scores.softmax(-1) @ v[:, :, kept]).transpose(1, 2).flatten(2)
    h = x[:, -1:] + block.attn.proj(y)
    h = model.final_norm(h + block.mlp(block.mlp_norm(h)))
    return (h @ model.token_embedding.weight.T)[:, 0]


@pytest.mark.parametrize("encoding", sorted(n for n, e in REGISTRY.items() if not e.recipe))
def test_a_window_keeps_positions_as_written_for_every_encoding(encoding: str) -> None:
    # Kept keys keep their positions (rotation, bias distance, embedding): the last token
    # under a window sees exactly the kept keys at their true positions.
    length, window, sinks = 40, 10, 3
    model = build_model(ONE_LAYER, encoding, train_length=length).eval()
    tokens = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(12))
    kept = torch.cat((torch.arange(sinks), torch.arange(length - (window - sinks), length)))
    torch.manual_seed(13)
    decoded = decode_logits(model, tokens, PROMPT, window=window, sinks=sinks)[:, -1]
    torch.manual_seed(13)
    with torch.no_grad():
        expected = _last_query_by_hand(model, tokens, kept)
    assert (decoded - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize("encoding", ["rope", "alibi", "sinusoidal"])
def test_greedy_passkey_answers_follow_the_teacher_forced_argmax(encoding: str) -> None:
    model = build_model(TINY, encoding, train_length=128).eval()
    task = Passkey()
    generator = torch.Generator().manual_seed(9)
    for depth in (0.0, 0.5, 1.0):
        sequence, answer_bytes, _ = task.example(120, generator, depth)
        tokens = torch.tensor([list(sequence)])
        prompt, answer = tokens[:, :-answer_bytes], tokens[0, -answer_bytes:]
        cache = new_cache(model, 1, tokens.shape[1])
        generated = greedy(model, prompt, answer_bytes, cache)[0]
        with torch.no_grad():
            forced = model(tokens[:, :-1])[0, -answer_bytes:].argmax(-1)
            # Fed its own answer, the forward picks each generated byte again.
            own = torch.cat((prompt[0], generated[:-1]))[None]
            replayed = model(own)[0, -answer_bytes:].argmax(-1)
        assert torch.equal(replayed, generated)
        for i in range(answer_bytes):
            if not torch.equal(generated[:i], answer[:i]):
                break
            assert generated[i] == forced[i]


def test_cache_options_are_checked_with_clear_messages() -> None:
    model = _rope_model()
    with pytest.raises(ValueError, match="cache_policy must be one of keep, rerotate"):
        new_cache(model, 1, 8, policy="refresh")
    with pytest.raises(ValueError, match="sinks need a window"):
        new_cache(model, 1, 8, sinks=2)
    with pytest.raises(ValueError, match=r"sinks must be an integer in \[0, window=4\)"):
        new_cache(model, 1, 8, window=4, sinks=4)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        new_cache(model, 1, 8, window=0)
    with pytest.raises(ValueError, match="'rerotate' rebuilds the cache from every token"):
        new_cache(model, 1, 8, window=4, policy="rerotate")
    cache = new_cache(model, 1, 4)
    prefill(model, torch.zeros(1, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="made for 4 tokens; 4 are written"):
        step(model, torch.zeros(1, dtype=torch.long), cache)
    cache = new_cache(model, 1, 8)
    with _scaled(model, STATIC[0]) as scaled, pytest.raises(ValueError, match="another encoding"):
        forward_cached(scaled, torch.zeros(1, 2, dtype=torch.long), cache)
    windowed = new_cache(model, 1, 16, window=4, sinks=1)
    prefill(model, torch.zeros(1, 4, dtype=torch.long), windowed)
    with pytest.raises(ValueError, match="write at most 3 at a time"):
        forward_cached(model, torch.zeros(1, 4, dtype=torch.long), windowed)
