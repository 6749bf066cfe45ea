"""Layer recipes (``local_global``, ``irope``): which kind each layer is, as transformers'
configs of Gemma 3, Cohere2, Llama 4 and SmolLM3 lay them out; every layer's attention
against a dense reference (its kind's rotation, window, chunks and query temperature);
one kind equal to the plain encoding bit for bit; decoding; scalings on the layers the
models scale; refusals at submit; a study that trains and evaluates each recipe."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import loss_gradients
from transformers import Cohere2Config, Gemma3TextConfig, Llama4TextConfig, SmolLM3Config

from core.spec import SpecError, parse_spec
from tests.test_evaluate import run_here
from worker.decode import decode_logits
from worker.encodings.layered import IRope, Layered, LocalGlobal
from worker.layers import ModelConfig
from worker.model import Transformer, build_model

SIX = ModelConfig(d_model=32, n_layers=6, n_heads=2)
TRAIN = 32
RECIPES = [
    ("local_global", {"pattern": 2, "window": 7}),
    ("local_global", {"pattern": 2, "window": 7, "global": "nope"}),
    ("irope", {"every": 3}),
    ("irope", {"every": 2, "chunk": 12, "temperature": 5}),
    ("irope", {"every": 3, "window": 9}),
]


def reach_of(name: str, params: dict, kind: int) -> tuple[int | None, int | None]:
    """The (window, chunk) a layer of ``kind`` has, read from the recipe's parameters."""
    if name == "local_global":
        return (params["window"] if kind == LocalGlobal.LOCAL else None), None
    return params.get("window"), (params.get("chunk") if kind == IRope.ROPE else None)


def reference_logits(
    model: Transformer, tokens: torch.Tensor, recipe: tuple[str, dict]
) -> torch.Tensor:
    """The forward written out densely, layer by layer: the layer's kind's tables, its
    query factors, and the window and chunks its ``recipe`` gives it as one mask."""
    config, batch, length = model.config, *tokens.shape
    heads, head_dim = config.n_heads, config.head_dim
    positions = torch.arange(length)
    x = model.token_embedding(tokens) * math.sqrt(config.d_model)
    query, key = positions[:, None], positions[None, :]
    layered = model.encoding
    for block, kind in zip(model.blocks, model.layer_kinds, strict=True):
        attn = block.attn
        qkv = attn.qkv(block.attn_norm(x)).view(batch, length, 3, heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        tables = model.kinds[kind].rotary_tables(positions)
        if tables is not None:
            q, k = tables.rotate(q, k)
        temperature = recipe[1].get("temperature")
        if isinstance(layered, IRope) and kind == IRope.NOPE and temperature:
            scale = 1 + 0.1 * torch.log(torch.floor((positions + 1) / temperature) + 1)
            q = q * scale[:, None]
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        window, chunk = reach_of(*recipe, kind)
        hidden = key > query
        if window is not None:
            hidden |= query - key >= window
        if chunk is not None:
            hidden |= query // chunk != key // chunk
        y = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v
        x = x + attn.proj(y.transpose(1, 2).reshape(batch, length, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return F.linear(model.final_norm(x), model.token_embedding.weight)


def _tokens(length: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(3))


def _recipe(name: str, params: dict, config: ModelConfig = SIX, seed: int = 1) -> Transformer:
    return build_model(config, name, train_length=TRAIN, seed=seed, **params)


# -- which kind each layer is ---------------------------------------------------------------


def test_local_global_lays_out_layers_as_gemma_3_and_cohere2() -> None:
    for config, pattern in ((Gemma3TextConfig(num_hidden_layers=12), 5), (Cohere2Config(), 3)):
        layers = config.num_hidden_layers
        model = _recipe("local_global", {"pattern": pattern}, ModelConfig(32, layers, 2))
        theirs = ["global" if t == "full_attention" else "local" for t in config.layer_types]
        ours = ["global" if k == LocalGlobal.GLOBAL else "local" for k in model.layer_kinds]
        assert ours == theirs
        windows = {block.attn.reach.window for block in model.blocks}
        assert windows == {TRAIN // 4, None}  # the derived default: a quarter of training


def test_irope_lays_out_nope_layers_as_llama_4_and_smollm3() -> None:
    for config in (Llama4TextConfig(num_hidden_layers=8), SmolLM3Config(num_hidden_layers=8)):
        model = _recipe("irope", {"every": 4}, ModelConfig(32, 8, 2))
        uses_rope = [int(kind == IRope.ROPE) for kind in model.layer_kinds]
        assert uses_rope == list(config.no_rope_layers)


def test_llama_4_temperature_follows_its_formula() -> None:
    """q x (1 + attn_scale log(floor((p + 1) / floor_scale) + 1)), attn_scale 0.1, on the
    NoPE layers only (transformers' Llama4TextAttention)."""
    config = Llama4TextConfig()
    recipe = _recipe("irope", {"every": 2, "temperature": 8}).encoding
    positions = torch.arange(100)
    expected = torch.log1p(torch.floor((positions + 1.0) / 8)) * config.attn_scale + 1.0
    torch.testing.assert_close(recipe.query_factors(IRope.NOPE, positions), expected)
    assert recipe.query_factors(IRope.ROPE, positions) is None
    assert float(recipe.query_factors(IRope.NOPE, positions)[6]) == 1.0  # before 8 tokens


# -- every path against the dense reference ------------------------------------------------


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize(("name", "params"), RECIPES, ids=str)
def test_each_recipe_equals_the_dense_reference(
    name: str, params: dict, implementation: str
) -> None:
    model = _recipe(name, params).eval()
    model.attn_implementation = implementation
    model.attention_score_budget = 2 * SIX.n_heads * 3 * TRAIN * 10  # query blocks of 10
    tokens = _tokens(3 * TRAIN)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens), reference_logits(model, tokens, (name, params)), rtol=1e-5, atol=2e-5
        )


@pytest.mark.parametrize(("name", "params"), RECIPES[::2], ids=str)
def test_training_gradients_of_a_recipe_equal_the_reference(name: str, params: dict) -> None:
    model = _recipe(name, params, seed=4).train()
    tokens = _tokens(TRAIN)
    grads = [
        loss_gradients(model, forward, tokens)
        for forward in (model, lambda t: reference_logits(model, t, (name, params)))
    ]
    for name_, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name_], rtol=1e-4, atol=1e-6, msg=name_)


@pytest.mark.parametrize(("name", "params"), RECIPES, ids=str)
def test_decoding_a_recipe_equals_its_one_pass_forward(name: str, params: dict) -> None:
    model = _recipe(name, params, seed=5).eval()
    tokens = _tokens(3 * TRAIN)
    with torch.no_grad():
        torch.testing.assert_close(
            decode_logits(model, tokens, 20), model(tokens), rtol=1e-4, atol=2e-5
        )


# -- one kind is the plain encoding --------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "plain"),
    [
        # every layer RoPE: NoPE every 8th layer of 6
        (("irope", {"every": 8, "base": 20000.0}), ("rope", {"base": 20000.0})),
        # every layer local: 6 local layers per global one, on 6 layers
        (("local_global", {"pattern": 6, "window": 9}), ("rope", {"window": 9})),
        # local and global the same: one base, a window that reaches every key
        (
            ("local_global", {"pattern": 1, "window": 96, "local_base": 1e4, "global_base": 1e4}),
            ("rope", {}),
        ),
    ],
    ids=["irope", "local-only", "same-kinds"],
)
def test_a_recipe_with_one_kind_of_layer_is_the_plain_encoding_bit_for_bit(
    recipe: tuple[str, dict], plain: tuple[str, dict]
) -> None:
    tokens = _tokens(3 * TRAIN)
    ours, theirs = (_recipe(name, params, seed=6).eval() for name, params in (recipe, plain))
    assert ours.num_parameters() == theirs.num_parameters()
    with torch.no_grad():
        assert torch.equal(ours(tokens), theirs(tokens))


# -- scalings -------------------------------------------------------------------------------


def test_a_scaling_applies_to_the_global_layers_only() -> None:
    """YaRN changes Gemma 3's global layers and leaves its local ones (their RoPE base and
    window are what they were trained with); iRoPE scales its RoPE layers."""
    model = _recipe("local_global", {"pattern": 2, "window": 7}).eval()
    positions = torch.arange(64)
    trained = [kind.rotary_tables(positions) for kind in model.kinds]
    with model.scaled("yarn", 4.0):
        scaled = [kind.rotary_tables(positions) for kind in model.kinds]
        assert model.encoding.kinds[LocalGlobal.GLOBAL].scaling is not None
    assert torch.equal(scaled[LocalGlobal.LOCAL].cos_q, trained[LocalGlobal.LOCAL].cos_q)
    assert not torch.equal(scaled[LocalGlobal.GLOBAL].cos_q, trained[LocalGlobal.GLOBAL].cos_q)
    assert model.encoding.kinds[LocalGlobal.GLOBAL].scaling is None  # put back
    irope = _recipe("irope", {"every": 2}).eval()
    with irope.scaled("pi", 2.0):
        assert isinstance(irope.encoding, Layered)
        assert irope.encoding.kinds[IRope.ROPE].scaling is not None


# -- the spec ------------------------------------------------------------------------------


def _spec(encoding: dict, **extra) -> dict:
    model = {"d_model": 32, "n_layers": 4, "n_heads": 2}
    return {"model": model, "train": {"length": 32, "steps": 2}, "encodings": [encoding], **extra}


@pytest.mark.parametrize(
    ("encoding", "extra", "wording"),
    [
        (
            {"name": "local_global", "window": 0},
            {},
            "local_global: parameter 'window' must be int in [1, 4194304], got 0",
        ),
        (
            {"name": "local_global", "pattern": 5},
            {},
            "pattern=5 needs at least 6 layers (the local ones, then a global); this model has 4",
        ),
        (
            {"name": "irope", "every": 8},
            {},
            "every=8 needs at least 8 layers (the RoPE ones, then a NoPE layer); this model has 4",
        ),
        (
            {"name": "local_global", "global": "alibi"},
            {},
            "local_global: parameter 'global' must be one of 'rope', 'nope', got 'alibi'",
        ),
        (
            {"name": "local_global", "pattern": 1, "global": "nope"},
            {"eval": {"lengths": [32, 64], "variants": ["none", "yarn:2"]}},
            "the scalings apply to the global layers, as Gemma 3's rope_scaling does, and "
            "they are NoPE here (global: nope)",
        ),
        (
            {"name": "irope", "every": 2, "chunk": 0},
            {},
            "irope: parameter 'chunk' must be int in [1, 4194304], got 0",
        ),
    ],
    ids=["window-0", "pattern-too-long", "every-too-long", "unknown-kind", "scaled-nope", "chunk"],
)
def test_an_invalid_recipe_is_refused_in_one_line(
    encoding: dict, extra: dict, wording: str
) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(_spec(encoding, **extra))
    message = str(refused.value)
    assert wording in message, message
    assert len(message.strip().splitlines()) == 1


def test_recipes_keep_their_parameters_in_the_label() -> None:
    spec = parse_spec(_spec({"name": "irope", "every": 2, "chunk": 16}))
    assert spec.encodings[0].label == "irope(every=2, chunk=16)"
    local = parse_spec(_spec({"name": "local_global", "pattern": 3, "global": "nope"}))
    assert local.encodings[0].label == "local_global(pattern=3, global=nope)"


def test_a_study_of_each_recipe_trains_and_evaluates_finite_curves() -> None:
    """Each recipe, proportional RoPE and a windowed encoding, through the engine a worker
    runs: trained on the CPU, finite at 1x to 8x, diagnostics on."""
    spec = parse_spec(
        {
            "model": {"d_model": 32, "n_layers": 4, "n_heads": 2},
            "train": {"length": 16, "steps": 6, "batch_size": 4},
            "encodings": [
                {"name": "local_global", "pattern": 1, "window": 4},
                {"name": "local_global", "pattern": 3, "window": 4, "global": "nope"},
                {"name": "irope", "every": 2, "chunk": 8, "temperature": 4},
                {"name": "rope", "rotary_fraction": 0.25, "proportional": True},
                {"name": "ssmax", "window": 8},
            ],
            "eval": {"lengths": [16, 32, 64, 128], "tokens": 512, "diagnostics": True},
        }
    )
    for run in spec.runs():
        evaluations = run_here(spec, run).evaluations
        assert [e.length for e in evaluations] == [16, 32, 64, 128], run.encoding.label
        assert all(math.isfinite(e.loss) for e in evaluations), run.encoding.label


def test_export_refuses_a_recipe_with_its_reason() -> None:
    from core.catalog.encodings import REGISTRY
    from core.catalog.params import EncodingConfigError

    for name in ("local_global", "irope"):
        entry = REGISTRY[name]
        with pytest.raises(EncodingConfigError, match="mixes kinds of layers: GPT-NeoX"):
            entry.hf_rotary(entry.resolve({}), 16, TRAIN)
