"""The attention implementations (worker.attention): which one runs, and the fused one
held to the written-out reference for every encoding that acts on the logits.

FlexAttention compiles once per shape (seconds each on the CPU), so the comparisons
that run it are marked slow; its backward is GPU-only and checked by the prepared device
script (benchmarks/gpu_checks.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import dims

from worker import attention, fused
from worker.attention import AttentionBias, choose
from worker.encodings import build
from worker.encodings.base import PositionEncoding
from worker.fused import Kernel, flex, score_mod
from worker.layers import CausalSelfAttention, ModelConfig
from worker.model import build_model
from worker.reach import Reach

BIASED = ["alibi", "t5", "kerple_log", "kerple_power", "fire"]
TRAIN = 24  # not a multiple of the kernel's 128-row tiles; nor are 2x, 4x, 8x
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def _varied(name: str, **kwargs: object):
    """A tiny model whose encoding's learned values are far from their initial ones (FIRE's
    MLP three times steeper: more bend per knot for the grid to get wrong)."""
    model = build_model("tiny", name, train_length=TRAIN, seed=3, **kwargs).eval()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.encoding.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(0.5 * noise)
        if name == "fire":
            for layer in (model.encoding.mlp[0], model.encoding.mlp[2]):
                layer.weight.mul_(3.0)
    return model


def _logits(model, tokens: torch.Tensor, implementation: str) -> torch.Tensor:
    model.attn_implementation = implementation
    with torch.no_grad():
        return model(tokens)


# -- which implementation runs --------------------------------------------------------------


def test_auto_is_flex_on_cuda_for_a_fusable_bias_and_sdpa_or_the_cpu_rule_elsewhere() -> None:
    def pick(device, has_bias=True, fusable=True, backward=False, learned=False) -> str:
        return choose(
            "auto",
            device=device,
            has_bias=has_bias,
            fusable=fusable,
            backward=backward,
            learned=learned,
        ).implementation

    assert pick(CUDA) == "flex_attention"
    assert pick(CUDA, backward=True, learned=True) == "flex_attention"
    assert pick(CUDA, has_bias=False) == "sdpa"  # flash
    assert pick(CUDA, fusable=False) == "sdpa"
    assert pick(CPU) == "sdpa"
    assert pick(CPU, backward=True) == "sdpa"  # ALiBi: SDPA's CPU kernel is faster
    assert pick(CPU, backward=True, learned=True) == "eager"  # T5, KERPLE, FIRE training


def test_flex_trains_through_sdpa_on_the_cpu_and_says_so() -> None:
    training = choose("flex_attention", device=CPU, has_bias=True, fusable=True, backward=True)
    assert training.implementation == "sdpa"
    assert "no backward on the CPU" in training.note
    evaluating = choose("flex_attention", device=CPU, has_bias=True, fusable=True, backward=False)
    assert evaluating == attention.Choice("flex_attention")
    # xPos past one table's span keeps its per-block decay, whatever was asked.
    decaying = choose(
        "flex_attention", device=CUDA, has_bias=False, fusable=False, backward=False, decay=True
    )
    assert decaying.implementation == "sdpa" and "decay" in decaying.note
    for asked in ("eager", "sdpa"):
        plain = choose(asked, device=CUDA, has_bias=True, fusable=True, backward=True)
        assert plain == attention.Choice(asked)
    with pytest.raises(ValueError, match="must be one of auto, eager, sdpa, flex_attention"):
        choose("flash", device=CPU, has_bias=False, fusable=False, backward=False)


def test_every_encoding_with_a_bias_has_a_fused_form_and_no_other_has_one() -> None:
    from worker.encodings import REGISTRY

    for name, entry in REGISTRY.items():
        encoding = build(name, **dims())
        assert encoding.fusable == encoding.has_bias == (entry.family == "bias"), name


def test_a_bias_read_from_a_table_per_pair_brings_tiles_that_the_kernel_accepts() -> None:
    """T5, KERPLE and FIRE read a table per (query, key) pair; PyTorch's default GPU tiles
    do not fit such a score_mod in an H200's shared memory (docs/performance.md, "Kernel
    tiles"). Each declares its tiles: option names FlexAttention knows, forward and
    backward block sizes that divide its 128-row sparse blocks and each other as its
    backward kernel requires. ALiBi reads one slope per head and keeps the defaults."""
    from typing import get_type_hints

    from torch.nn.attention.flex_attention import FlexKernelOptions

    from worker.encodings import REGISTRY

    known = set(get_type_hints(FlexKernelOptions))
    reads_per_pair = {"t5", "kerple_log", "kerple_power", "fire"}
    for name in REGISTRY:
        tiles = build(name, **dims()).flex_tiles
        assert (tiles is not None) == (name in reads_per_pair), name
        if tiles is None:
            continue
        bare = {
            key.removeprefix("fwd_").removeprefix("bwd_"): value for key, value in tiles.items()
        }
        assert set(bare) <= known, (name, set(bare) - known)
        assert all(128 % bare[key] == 0 for key in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N2"))
        assert bare["BLOCK_N1"] % bare["BLOCK_M1"] == 0 and bare["BLOCK_M2"] % bare["BLOCK_N2"] == 0
        assert all(key.startswith(("fwd_", "bwd_")) for key in tiles if key.startswith("BLOCK"))


def test_the_tiles_reach_the_kernel_on_a_gpu_only(monkeypatch) -> None:
    """On the CPU flex_attention is called without kernel options (its kernel has none of
    these); on a GPU with a copy of the encoding's; through the model's pass both ways."""
    t5 = build("t5", **dims())
    assert fused.kernel_options(t5.flex_tiles, torch.device("cpu")) is None
    on_gpu = fused.kernel_options(t5.flex_tiles, torch.device("cuda"))
    assert on_gpu == t5.flex_tiles and on_gpu is not t5.flex_tiles
    assert fused.kernel_options(None, torch.device("cuda")) is None
    calls = []

    def kernel(q, k, v, *, score_mod, block_mask, kernel_options):
        calls.append(kernel_options)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    monkeypatch.setattr(fused, "_compiled_kernel", lambda: kernel)
    model = build_model("tiny", "t5", train_length=TRAIN, attn_implementation="flex_attention")
    with torch.no_grad():  # evaluation: flex on the CPU too
        pass_kernel = model.attention_kernel(1, TRAIN, CPU, torch.float32)
        assert pass_kernel.tiles == t5.flex_tiles
        q = torch.randn(1, 2, TRAIN, 8)
        flex(q, q, q, pass_kernel.score_mod, mask=pass_kernel.block_mask(), tiles=pass_kernel.tiles)
    assert calls == [None]


def test_a_fallback_is_told_once_per_model_and_what_ran_is_recorded(caplog) -> None:
    model = build_model("tiny", "alibi", train_length=TRAIN, attn_implementation="flex_attention")
    tokens = torch.randint(0, 256, (2, TRAIN))
    with caplog.at_level(logging.WARNING, logger="posbench.attention"):
        for _ in range(3):
            model(tokens).sum().backward()
    told = [r.getMessage() for r in caplog.records if "no backward on the CPU" in r.getMessage()]
    assert len(told) == 1
    assert model.attention_record() == {
        "requested": "flex_attention",
        "train": "sdpa",
        "eval": None,
    }
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        build_model("tiny", "alibi", train_length=TRAIN, attn_implementation="flash")


def test_eager_and_sdpa_agree_for_every_encoding_in_value_and_gradient() -> None:
    from worker.encodings import REGISTRY

    tokens = torch.randint(0, 256, (2, 3 * TRAIN + 5), generator=torch.Generator().manual_seed(0))
    for name in REGISTRY:
        model = build_model("tiny", name, train_length=TRAIN, seed=1)
        tokens_here = tokens[:, :TRAIN] if name == "learned" else tokens  # its table's rows
        grads = {}
        for implementation in ("eager", "sdpa"):
            model.zero_grad()
            model.attn_implementation = implementation
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # randomized positions draw the same
                model(tokens_here).logsumexp(-1).mean().backward()
            grads[implementation] = [p.grad.clone() for p in model.parameters()]
        for eager, sdpa in zip(grads["eager"], grads["sdpa"], strict=True):
            torch.testing.assert_close(sdpa, eager, rtol=1e-4, atol=1e-5, msg=name)
        # CoPE's term has no fused form: asked for sdpa, it is written out (with a note).
        ran = ["eager"] if REGISTRY[name].family == "contextual" else ["eager", "sdpa"]
        assert model.attention_ran["train"] == ran, name


@pytest.mark.parametrize("name", BIASED)
def test_each_bias_mod_is_its_bias_pair_by_pair(name: str) -> None:
    """The fused form evaluated directly on every (head, query, key), both ways; FIRE's grid
    within 1e-5 of its MLP."""
    model = _varied(name)
    encoding = model.encoding
    length = 8 * TRAIN + 3
    h = torch.arange(encoding.n_heads)[:, None, None]
    q = torch.arange(length)[None, :, None]
    k = torch.arange(length)[None, None, :]
    with torch.no_grad():
        for causal in (True, False):
            fused = encoding.bias_mod(length, causal)(h, q, k).expand(-1, length, length)
            reference = encoding.bias(length, length)
            if causal:  # above the diagonal the mask drops whatever the mod says
                visible = torch.ones(length, length, dtype=torch.bool).tril()
                fused, reference = fused[:, visible], reference[:, visible]
            torch.testing.assert_close(fused, reference, rtol=0, atol=1e-5, msg=(name, causal))


def test_the_base_encoding_has_no_fused_form() -> None:
    assert PositionEncoding.bias_mod(build("nope", **dims()), 8) is None


# -- the fused kernel against the reference (compiles: slow) ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", BIASED)
def test_flex_equals_eager_for_each_bias_from_1x_to_8x_and_with_log_n(name: str) -> None:
    model = _varied(name)
    generator = torch.Generator().manual_seed(5)
    for factor in (1, 2, 4, 8):
        tokens = torch.randint(0, 256, (1, factor * TRAIN), generator=generator)
        eager = _logits(model, tokens, "eager")
        fused = _logits(model, tokens, "flex_attention")
        torch.testing.assert_close(fused, eager, rtol=0, atol=1e-5, msg=(name, factor))
    # Log-n scaling: the bias multiplied by each query's factor inside the score_mod.
    model.logn_length = TRAIN
    tokens = torch.randint(0, 256, (1, 4 * TRAIN), generator=generator)
    plain = _logits(model, tokens, "eager")
    torch.testing.assert_close(
        _logits(model, tokens, "flex_attention"), plain, rtol=0, atol=1e-5, msg=name
    )
    assert model.attention_ran["eval"] == ["eager", "flex_attention"]


@pytest.mark.slow
@pytest.mark.parametrize("name", BIASED)
def test_flex_equals_the_two_way_probes_bias(name: str) -> None:
    encoding = _varied(name).encoding
    config = ModelConfig(d_model=encoding.d_model, n_layers=1, n_heads=encoding.n_heads)
    torch.manual_seed(0)
    layer = CausalSelfAttention(config)
    x = torch.randn(1, 40, encoding.d_model)
    with torch.no_grad():
        bias = AttentionBias(encoding, 40, 1, torch.float32, CPU, budget=1 << 62, causal=False)
        reference = layer(x, None, bias, causal=False)
        mod = score_mod(encoding.bias_mod(40, causal=False), None)
        fused = layer(x, None, None, causal=False, kernel=Kernel("flex_attention", mod))
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_sliding_window_masks_exactly_the_keys_out_of_reach() -> None:
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=generator) for _ in range(3))
    window = 33
    i, j = torch.arange(150)[:, None], torch.arange(150)[None, :]
    visible = Reach(window=window).mask_mod()(None, None, i, j)
    assert visible.sum(1).max() == window and bool(visible.diagonal().all())
    scores = (q @ k.transpose(-1, -2)) / 4.0
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
    with torch.no_grad():
        fused = flex(q, k, v, None, reach=Reach(window=window))
    torch.testing.assert_close(fused, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_past_the_shape_limit_flex_runs_on_sdpa_with_a_note(monkeypatch, caplog) -> None:
    monkeypatch.setattr(fused, "_shapes", set())
    monkeypatch.setattr("worker.model.fits_compiled", lambda key: False)
    model = _varied("alibi")
    tokens = torch.randint(0, 256, (1, TRAIN))
    with caplog.at_level(logging.WARNING, logger="posbench.attention"):
        logits = _logits(model, tokens, "flex_attention")
    torch.testing.assert_close(logits, _logits(model, tokens, "eager"), rtol=0, atol=1e-5)
    assert model.attention_ran["eval"] == ["sdpa", "eager"]
    assert any("shapes compiled" in r.getMessage() for r in caplog.records)


def test_the_compiled_kernel_counts_its_shapes(monkeypatch) -> None:
    monkeypatch.setattr(fused, "_shapes", set())
    monkeypatch.setattr(fused, "MAX_FLEX_SHAPES", 2)
    assert fused.fits_compiled(("a",)) and fused.fits_compiled(("b",))
    assert fused.fits_compiled(("a",))  # compiled already
    assert not fused.fits_compiled(("c",))
    assert fused.compiled_shapes() == 2


# -- a study under each implementation ---------------------------------------------------------


@pytest.mark.slow
def test_a_study_gives_the_same_perplexities_under_every_implementation(tmp_path, monkeypatch):
    """Trained and evaluated three times, once per implementation, on the CPU in float32:
    the same curve to 1e-5, and results.json says what trained and what evaluated."""
    from conftest import study_results

    monkeypatch.setenv("POSBENCH_HOME", str(tmp_path))
    from core.settings import get_settings

    get_settings.cache_clear()
    curves, records = {}, {}
    for implementation in ("eager", "sdpa", "flex_attention"):
        spec = {
            "name": f"kernels-{implementation}",
            "model": {"preset": "tiny", "attn_implementation": implementation},
            "train": {"length": TRAIN, "steps": 12, "batch_size": 4, "val_every": 0},
            "encodings": ["alibi", "kerple_log"],
            "eval": {"lengths": [TRAIN, 4 * TRAIN], "tokens": 2048, "variants": ["none", "logn"]},
        }
        document = study_results(spec, device="cpu")
        curves[implementation] = {
            (run["label"], row["variant"], row["length"]): row["perplexity"]
            for run in document["runs"]
            for row in run["evaluations"]
        }
        records[implementation] = {
            run["label"]: run["provenance"]["attn_implementation"] for run in document["runs"]
        }
    for implementation in ("sdpa", "flex_attention"):
        assert curves[implementation].keys() == curves["eager"].keys()
        for point, value in curves["eager"].items():
            assert curves[implementation][point] == pytest.approx(value, rel=1e-5), point
    assert records["eager"]["alibi"] == {"requested": "eager", "train": "eager", "eval": "eager"}
    assert records["sdpa"]["kerple_log"] == {"requested": "sdpa", "train": "sdpa", "eval": "sdpa"}
    assert records["flex_attention"]["kerple_log"] == {
        "requested": "flex_attention",
        "train": "sdpa",  # no flex backward on the CPU
        "eval": "flex_attention",
    }


def test_the_implementation_is_an_execution_choice_in_the_spec_not_part_of_any_hash() -> None:
    from core.spec import parse_spec
    from core.spec.base import SpecError

    base = {"model": "tiny", "encodings": ["alibi"], "train": {"length": 32}}
    plain = parse_spec(base)
    assert plain.model.attn_implementation == "auto"
    fused = parse_spec(
        {**base, "model": {"preset": "tiny", "attn_implementation": "flex_attention"}}
    )
    run, fused_run = plain.runs()[0], fused.runs()[0]
    assert (run.config_hash, run.train_hash) == (fused_run.config_hash, fused_run.train_hash)
    with pytest.raises(SpecError, match="attn_implementation") as refused:
        parse_spec({**base, "model": {"preset": "tiny", "attn_implementation": "flash"}})
    assert "flex_attention" in str(refused.value)
    hf = {"model": {"hf": "gpt2", "attn_implementation": "eager"}, "train": {"length": 64}}
    with pytest.raises(SpecError, match="runs as transformers runs it"):
        parse_spec({**hf, "encodings": []})


def test_posbench_run_refuses_an_unknown_implementation_before_anything_runs(tmp_path) -> None:
    from conftest import isolated_env, posbench_cli

    result = posbench_cli(
        "run", "--preset", "smoke", "--attn-implementation", "flash", env=isolated_env(tmp_path)
    )
    assert result.returncode == 2
    assert "--attn-implementation must be one of auto, eager, sdpa, flex_attention" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", ["t5", "fire"])
def test_a_compiled_model_traces_the_bias_into_the_fused_kernel(name: str) -> None:
    """train.compile with flex: the bias_mod's tables are built inside the compiled graph
    and the kernel traced with them; the only break is the block mask's lookup (outside
    the graph, built once per length). Forward only: the CPU has no flex backward."""
    from torch._dynamo.utils import counters

    model = _varied(name)
    tokens = torch.randint(0, 256, (2, 2 * TRAIN), generator=torch.Generator().manual_seed(4))
    expected = _logits(model, tokens, "eager")
    model.attn_implementation = "flex_attention"
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        fused = torch.compile(model)(tokens)
    torch.testing.assert_close(fused, expected, rtol=0, atol=1e-5)
    reasons = list(counters["graph_break"])
    assert len(reasons) == 1 and "block_mask" in reasons[0], reasons
    torch._dynamo.reset()
