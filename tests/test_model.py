"""The transformer the encodings plug into: symmetry, training, long inputs, fairness."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import dims
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.attention import (
    AttentionBias,
    fused_biased_attention,
    written_out,
    written_out_biased_attention,
)
from worker.encodings import REGISTRY, build
from worker.encodings.base import PositionOutOfRange, causal_toeplitz
from worker.encodings.rotary import RotaryTables, rotate_pairs
from worker.layers import CausalSelfAttention, ModelConfig, split_heads
from worker.model import PRESETS, build_model
from worker.probes import equivariance_error

ALL = sorted(REGISTRY)
TRAIN_LENGTH = 16


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(2, 24))
def test_attention_without_positions_is_permutation_equivariant(seed: int, length: int) -> None:
    assert equivariance_error(build("nope", **dims()), length=length, seed=seed) < 1e-5


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_sinusoidal_positions_break_equivariance(seed: int) -> None:
    assert equivariance_error(build("sinusoidal", **dims()), length=16, seed=seed) > 0.05


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_the_causal_mask_alone_breaks_equivariance(seed: int) -> None:
    # Why NoPE can work in a decoder: token t sees exactly t predecessors.
    assert equivariance_error(build("nope", **dims()), length=16, causal=True, seed=seed) > 0.05


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "fire"])
def test_every_position_signal_breaks_equivariance(name: str) -> None:
    assert equivariance_error(build(name, **dims()), length=16) > 0.01


@pytest.mark.parametrize("name", ALL)
def test_each_encoding_trains_the_tiny_model_without_nan(name: str) -> None:
    model = build_model("tiny", name, train_length=TRAIN_LENGTH, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    # A repeated batch of a periodic byte pattern: learnable only from context.
    pattern = torch.randint(0, 256, (8, 5), generator=generator)
    batch = pattern.repeat(1, 4)[:, : TRAIN_LENGTH + 1]
    losses = []
    for _ in range(25):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("name", ALL)
def test_forward_at_16x_the_training_length(name: str) -> None:
    model = build_model("tiny", name, train_length=TRAIN_LENGTH, seed=0).eval()
    tokens = torch.randint(0, 256, (1, 16 * TRAIN_LENGTH))
    if name == "learned":
        with pytest.raises(
            PositionOutOfRange, match=rf"position {16 * TRAIN_LENGTH - 1} is beyond"
        ):
            model(tokens)
        return
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (1, 16 * TRAIN_LENGTH, 256)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", sorted(n for n, e in REGISTRY.items() if e.family == "bias"))
def test_query_blocks_give_the_same_logits_as_the_full_bias(name: str) -> None:
    model = build_model("tiny", name, train_length=TRAIN_LENGTH, seed=0).eval()
    tokens = torch.randint(0, 256, (2, 100))
    with torch.no_grad():
        full = model(tokens)
        model.attention_score_budget = 2 * 4 * 100 * 7  # blocks of 7 query rows
        blocked = model(tokens)
    torch.testing.assert_close(blocked, full, atol=1e-5, rtol=1e-5)


def test_fused_and_written_out_biased_attention_agree_in_value_and_gradient() -> None:
    # The fused kernel (evaluation, GPUs) and the written-out path (CPU training)
    # compute the same thing, the gradient of a learned bias included.
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 8, generator=generator)
    distances = torch.randn(4, 40, generator=generator)
    keys, values = (torch.randn(2, 4, 40, 8, generator=generator) for _ in range(2))
    results = []
    for attend in (fused_biased_attention, written_out_biased_attention):
        learned = distances.clone().requires_grad_(True)
        inputs = [t.clone().requires_grad_(True) for t in (q, keys, values)]
        # queries 16..39 over keys 0..39
        out = attend(*inputs, causal_toeplitz(learned, 16, 40))
        out.pow(2).sum().backward()
        results.append((out, *(t.grad for t in inputs), learned.grad))
    for fused, written in zip(*results, strict=True):
        torch.testing.assert_close(fused, written, atol=1e-5, rtol=1e-5)


def test_biased_attention_writes_out_only_a_learned_bias_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert written_out(cpu, bias_needs_grad=True)
    assert not written_out(cpu, bias_needs_grad=False)
    assert not written_out(torch.device("cuda"), bias_needs_grad=True)
    # A learned bias in training gets shorter query blocks than the fused kernel.
    for name, training_rows in (("kerple_log", 128), ("t5", 128), ("alibi", 256)):
        encoding = build(name, **dims(n_heads=4))
        assert AttentionBias(encoding, 1024, 2, torch.float32, cpu).block_rows == training_rows
        with torch.no_grad():
            assert AttentionBias(encoding, 1024, 2, torch.float32, cpu).block_rows == 256


def test_causal_toeplitz_is_the_bias_at_each_query_key_distance() -> None:
    distances = torch.arange(12.0).repeat(2, 1) * torch.tensor([[1.0], [-2.0]])
    for start, end in ((0, 12), (5, 9), (11, 12)):
        rows = causal_toeplitz(distances, start, end)
        assert rows.shape == (2, end - start, end)
        for i in range(start, end):
            for j in range(end):
                expected = distances[:, i - j] if j <= i else torch.full((2,), float("-inf"))
                assert torch.equal(rows[:, i - start, j], expected)


def test_attention_bias_blocks_bound_the_score_memory() -> None:
    encoding = build("alibi", **dims(n_heads=4))
    bias = AttentionBias(encoding, 32_768, 1, torch.float32, torch.device("cpu"))
    assert bias.full is None
    assert bias.block_rows * 4 * 32_768 <= 1 << 24
    rows = bias.rows(1000, 1000 + bias.block_rows)
    assert rows.shape == (4, bias.block_rows, 1000 + bias.block_rows)
    # Causal: query 1000 sees keys up to 1000 and nothing after.
    assert torch.isinf(rows[:, 0, 1001:]).all() and torch.isfinite(rows[:, 0, :1001]).all()


def test_causal_mask_hides_the_future() -> None:
    for name in ("nope", "alibi"):
        model = build_model("tiny", name, train_length=TRAIN_LENGTH, seed=0).eval()
        tokens = torch.randint(0, 256, (1, 20))
        changed = tokens.clone()
        changed[0, 10:] = (changed[0, 10:] + 1) % 256
        with torch.no_grad():
            torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])


def test_same_seed_gives_every_encoding_the_same_starting_weights() -> None:
    models = [build_model("tiny", name, train_length=TRAIN_LENGTH, seed=7) for name in ALL]
    reference = {k: v for k, v in models[0].state_dict().items() if not k.startswith("encoding.")}
    for model in models[1:]:
        for key, value in model.state_dict().items():
            if not key.startswith("encoding."):
                assert torch.equal(value, reference[key]), key
    other_seed = build_model("tiny", "nope", train_length=TRAIN_LENGTH, seed=8)
    assert not torch.equal(other_seed.token_embedding.weight, models[0].token_embedding.weight)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "sinusoidal"])
def test_bf16_autocast_forward(name: str) -> None:
    model = build_model("tiny", name, train_length=TRAIN_LENGTH, seed=0).eval()
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        exact = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(tokens)
    assert low.dtype == torch.float32  # the body runs in bf16, the head in float32
    assert (low - exact).abs().mean() < 0.1 * exact.abs().mean()
    assert not torch.equal(low, exact)


def test_rope_scaling_is_scoped_to_the_context() -> None:
    model = build_model("tiny", "rope", train_length=TRAIN_LENGTH, seed=0).eval()
    tokens = torch.randint(0, 256, (1, 64))
    with torch.no_grad():
        plain = model(tokens)
        with model.scaled("pi", 4.0) as scaled:
            interpolated = scaled(tokens)
        again = model(tokens)
    assert not torch.allclose(plain, interpolated)
    torch.testing.assert_close(plain, again)
    with pytest.raises(ValueError, match="rotary encodings only, not 'alibi'"):
        build_model("tiny", "alibi", train_length=TRAIN_LENGTH).scaled("pi", 2.0).__enter__()


def test_presets_and_bad_shapes() -> None:
    assert PRESETS["small"] == ModelConfig(d_model=128, n_layers=4, n_heads=4)
    assert PRESETS["small"].head_dim == 32
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        build_model("huge", "nope", train_length=8)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=100, n_heads=3)


def test_parameter_count_and_flops() -> None:
    model = build_model("small", "nope", train_length=128)
    # 4 layers x (qkv 3d^2 + proj d^2 + mlp 8d^2) + embedding 256 d, with d = 128
    matmul = 4 * 12 * 128**2 + 256 * 128
    norms = (2 * 4 + 1) * 128
    assert model.num_parameters() == matmul + norms
    assert model.flops_per_token(128) == 6 * matmul + 12 * 4 * 128 * 128


def test_bias_is_added_to_the_logits_unscaled_by_sqrt_d() -> None:
    # q = k = 0 leaves the bias as the only logit, so the attention weights must be
    # exactly softmax(-m * distance), not softmax(-m * distance / sqrt(head_dim)).
    config = ModelConfig(d_model=16, n_layers=1, n_heads=1, vocab_size=1)
    encoding = build("alibi", n_heads=1, head_dim=16, d_model=16, train_length=8)
    attention = CausalSelfAttention(config)
    with torch.no_grad():
        attention.qkv.weight.zero_()
        attention.qkv.weight[32:].copy_(torch.eye(16))  # v = x
        attention.proj.weight.copy_(torch.eye(16))
    length = 6
    x = torch.randn(1, length, 16)
    bias = AttentionBias(encoding, length, 1, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        out = attention(x, None, bias)
    slope = 2.0**-8  # one head: slope 2^(-8/1)
    for t in range(length):
        weights = torch.softmax(-slope * torch.arange(t, -1, -1, dtype=torch.float32), dim=0)
        torch.testing.assert_close(out[0, t], weights @ x[0, : t + 1])


def _composite_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE written the textbook way, x * cos + rotate_half(x) * sin, in plain autograd ops."""
    half = cos.shape[-1]
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin, rest), dim=-1)


def _tables(length: int, half: int, per_sequence: int | None = None) -> RotaryTables:
    generator = torch.Generator().manual_seed(length + half)
    shape = (per_sequence, 1, length, half) if per_sequence else (length, half)
    angle = torch.rand(shape, generator=generator, dtype=torch.float64) * 50
    scale = 0.5 + torch.rand(shape, generator=generator, dtype=torch.float64)
    # q and k get different tables, as xPos's do (scale and 1 / scale).
    return RotaryTables(
        angle.cos() * scale, angle.sin() * scale, angle.cos() / scale, angle.sin() / scale
    )


def _table_tensors(tables: RotaryTables) -> tuple[torch.Tensor, ...]:
    return tables.cos_q, tables.sin_q, tables.cos_k, tables.sin_k


@pytest.mark.parametrize(("head_dim", "rotary_half", "per_sequence"), [(8, 4, None), (8, 2, 2)])
def test_split_heads_rotates_and_its_gradient_is_exact(
    head_dim: int, rotary_half: int, per_sequence: int | None
) -> None:
    # Full and partial rotary, shared and per-sequence positions, in float64 against
    # autograd's numerical gradient and against the textbook composite.
    batch, length, heads = 2, 5, 3
    tables = _tables(length, rotary_half, per_sequence)
    qkv = torch.randn(batch, length, 3 * heads * head_dim, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: split_heads(t, heads, tables), (qkv,))
    assert torch.autograd.gradcheck(lambda t: split_heads(t, heads, None), (qkv,))
    q, k, v = split_heads(qkv, heads, tables)
    ref_q, ref_k, ref_v = qkv.view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(q, _composite_rotation(ref_q, tables.cos_q, tables.sin_q))
    torch.testing.assert_close(k, _composite_rotation(ref_k, tables.cos_k, tables.sin_k))
    torch.testing.assert_close(v, ref_v)
    grads = [torch.randn_like(t) for t in (q, k, v)]
    ours = torch.autograd.grad((q, k, v), qkv, grads)[0]
    reference = (
        _composite_rotation(ref_q, tables.cos_q, tables.sin_q),
        _composite_rotation(ref_k, tables.cos_k, tables.sin_k),
        ref_v,
    )
    torch.testing.assert_close(ours, torch.autograd.grad(reference, qkv, grads)[0])
    # One output unused: its gradient is zero, the others unchanged.
    only_v = torch.autograd.grad(split_heads(qkv, heads, tables)[2].sum(), qkv)[0]
    assert only_v.view(batch, length, 3, -1)[:, :, :2].abs().max() == 0
    assert (only_v.view(batch, length, 3, -1)[:, :, 2] == 1).all()


def test_rotation_runs_in_float32_for_bf16_inputs() -> None:
    # bf16 carries 8 mantissa bits: the rotation is computed wide and rounded once.
    tables = _tables(7, 4)
    tables = RotaryTables(*(t.float() for t in _table_tensors(tables)))
    x = torch.randn(2, 3, 7, 8)
    low = rotate_pairs(x.bfloat16(), tables.cos_q, tables.sin_q)
    assert low.dtype == torch.bfloat16
    wide = _composite_rotation(x.bfloat16().float(), tables.cos_q, tables.sin_q)
    torch.testing.assert_close(low, wide.bfloat16(), atol=0, rtol=0)
    qkv = torch.randn(2, 7, 3 * 3 * 8, dtype=torch.bfloat16, requires_grad=True)
    outputs = split_heads(qkv, 3, tables)
    grads = [torch.randn_like(t) for t in outputs]
    low_grad = torch.autograd.grad(outputs, qkv, grads)[0]
    wide_qkv = qkv.detach().float().requires_grad_()
    wide_out = split_heads(wide_qkv, 3, tables)
    wide_grad = torch.autograd.grad(wide_out, wide_qkv, [g.float() for g in grads])[0]
    assert low_grad.dtype == torch.bfloat16
    torch.testing.assert_close(low_grad, wide_grad.bfloat16(), atol=0, rtol=0)


def test_rotary_tables_are_built_once_per_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(ModelConfig(d_model=16, n_layers=3, n_heads=2), "rope", train_length=8)
    calls = []
    built = model.encoding.rotary_tables
    monkeypatch.setattr(model.encoding, "rotary_tables", lambda p: calls.append(p) or built(p))
    model(torch.randint(0, 256, (2, 8)))
    assert len(calls) == 1


def test_rotary_tables_take_no_gradient() -> None:
    tables = _tables(4, 2)
    learned = tables.cos_q.clone().requires_grad_()
    with pytest.raises(ValueError, match="take no gradient"):
        split_heads(torch.randn(1, 4, 3 * 8), 2, RotaryTables(learned, *_table_tensors(tables)[1:]))
    with pytest.raises(ValueError, match="take no gradient"):
        rotate_pairs(torch.randn(1, 1, 4, 4), learned, tables.sin_q)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", ["xpos", "learned"])
def test_the_model_compiles_as_one_graph_and_matches_eager(name: str) -> None:
    # spec.compile (the GPU path) must not graph-break in the hot loop: the rotation's
    # strided writes and the learned table's range check step aside under compile.
    torch._dynamo.reset()
    model = build_model(ModelConfig(d_model=16, n_layers=2, n_heads=2), name, train_length=8)
    tokens = torch.randint(0, 256, (2, 8))
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(tokens)
    grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
    expected = model(tokens)
    expected_grads = torch.autograd.grad(expected.square().mean(), list(model.parameters()))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: build("alibi", n_heads=4, head_dim=16, d_model=999, train_length=8),
            "d_model=999 must equal n_heads x head_dim = 4 x 16",
        ),
        (
            lambda: build("learned", n_heads=4, head_dim=16, d_model=64, train_length=10**9),
            "train_length=1000000000 exceeds the limit",
        ),
        (
            lambda: build(
                "randomized", n_heads=4, head_dim=16, d_model=64, train_length=256, max_position=16
            ),
            "max_position = 16 must be at least the training length 256",
        ),
        (lambda: ModelConfig(n_heads=0), "n_heads must be a positive integer, got 0"),
        (
            lambda: build_model("tiny", "rope", train_length=16, seed="x"),
            "seed must be an integer in [0, 2^63), got 'x'",
        ),
        (lambda: build_model("tiny", "rope", train_length=16, seed=2**70), "seed must be"),
    ],
)
def test_the_python_api_refuses_bad_shapes_and_seeds(make, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        make()
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("yarn", {"factor": "4"}, "factor must be a number, got '4'"),
        ("pi", {"factor": True}, "factor must be a number, got True"),
        ("pi", {"factor": 4.0, "original_length": -5}, "original_length must be a positive"),
        ("dynamic_ntk", {"original_length": 0.5}, "original_length must be a positive"),
    ],
)
def test_scaled_refuses_bad_factors_and_lengths(method: str, options: dict, message: str) -> None:
    model = build_model("tiny", "rope", train_length=16)
    with pytest.raises(ValueError, match=re.escape(message)), model.scaled(method, **options):
        pass
