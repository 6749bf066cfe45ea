"""The 2025-26 families through the ``hf:`` evaluator (issue 46): Qwen3, Gemma 2, Gemma 3
(text), Phi-3, Cohere2, OLMo 2, SmolLM3 and Llama 4's text model, tiny and random, made
here as transformers' own tests make them (tests/hf_models.py: 6 layers so each one's
pattern of layers shows, a sliding window or chunk of 8 tokens, shorter than the
lengths evaluated).

posbench's loss equals transformers' own forward with eager attention in float32 on the
same windows, for the non-overlapping and the sliding protocol, inside and past the
original context; a RoPE scaling lands on the layers the model's own config scales (Gemma
3: its global layers only); both config forms (``rope_parameters``, per layer type or
not, and the older ``rope_theta`` / ``rope_scaling``) say the same; a field posbench
does not read refuses the model, naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import CONTEXT, NEW_FAMILIES, save_model
from test_hf_model import nonoverlapping, posbench_row, reference, sliding, text_task

from core.catalog.hf_configs import model_facts
from core.catalog.hf_models import HfModelError, ModelPolicy
from worker.diagnostics import AttentionProbe
from worker.hf.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def families_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    for family in NEW_FAMILIES:
        save_model(root / family, family)
    return root


@pytest.fixture(scope="module")
def families(families_root: Path) -> dict[str, LoadedModel]:
    policy = ModelPolicy(roots=(families_root.resolve(),))
    return {family: load_model(family, policy) for family in NEW_FAMILIES}


def eager(folder: Path, config: Any = None):
    """transformers' own model from ``folder``: eager attention, float32."""
    from transformers import AutoModelForCausalLM

    extra = {} if config is None else {"config": config}
    return AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32, **extra
    ).eval()


def _windows(protocol: str, usable: int, length: int, stride: int | None):
    if protocol == "nonoverlapping":
        return nonoverlapping(usable, length)
    return sliding(usable, length, stride or length)


def _loss_pair(model: LoadedModel, theirs, length: int, protocol: str, stride=None, variant="none"):
    """(posbench's loss, transformers' loss) on the same windows of the tiny corpus."""
    task = text_task(model.tokenizer)
    usable = (len(task.ids) - length) // length * length
    task.ids, task.bytes = task.ids[: usable + length], task.bytes[: usable + length]
    row = posbench_row(model.model, task, length, protocol, variant, stride=stride)
    nats, count = reference(theirs, task.ids, _windows(protocol, usable, length, stride))
    assert row.tokens == count
    return row.loss, nats / count


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize(
    ("protocol", "length", "stride"),
    [("nonoverlapping", 16, None), ("nonoverlapping", 2 * CONTEXT, None), ("sliding", 24, 6)],
)
def test_each_family_is_transformers_own_forward_on_every_protocol(
    families: dict[str, LoadedModel],
    families_root: Path,
    family: str,
    protocol: str,
    length: int,
    stride: int | None,
) -> None:
    model = families[family]
    assert model.facts.model_type == family
    ours, theirs = _loss_pair(model, eager(families_root / family), length, protocol, stride)
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_each_family_shows_its_pattern_of_layers(families: dict[str, LoadedModel]) -> None:
    kinds = {family: families[family].facts.layer_types for family in NEW_FAMILIES}
    full, sliding_, chunked = "full_attention", "sliding_attention", "chunked_attention"
    assert kinds["gemma2"] == (sliding_, full) * 3  # in turn
    assert kinds["gemma3_text"] == (sliding_, sliding_, full) * 2  # 2 local : 1 global here
    assert kinds["cohere2"] == (sliding_, sliding_, sliding_, full, sliding_, sliding_)
    assert kinds["llama4_text"] == (chunked, chunked, full) * 2
    assert families["gemma3_text"].facts.rope_per_layer_type
    # Gemma 3's global layers' RoPE is what a scaling changes: base 1M, not the local 10k.
    assert families["gemma3_text"].facts.rotary.base == 1e6


# -- scalings on the layers the model scales ----------------------------------------------


def _yarn(factor: float) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": CONTEXT}


def test_gemma_3s_scaling_changes_its_global_layers_only(
    families: dict[str, LoadedModel], families_root: Path
) -> None:
    """yarn:4 on Gemma 3 is the model with YaRN written into its global layers' rope
    parameters by hand, the sliding-window layers' left as they were."""
    from transformers import AutoConfig

    folder = families_root / "gemma3_text"
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    rope = dict(config.rope_parameters)
    assert set(rope) == {"full_attention", "sliding_attention"}
    config.rope_parameters = {**rope, "full_attention": {"rope_theta": 1e6, **_yarn(4.0)}}
    length = 2 * CONTEXT
    ours, theirs = _loss_pair(
        families["gemma3_text"], eager(folder, config), length, "nonoverlapping", variant="yarn:4"
    )
    assert ours == pytest.approx(theirs, rel=1e-5)
    plain, _ = _loss_pair(families["gemma3_text"], eager(folder), length, "nonoverlapping")
    assert plain != pytest.approx(ours, rel=1e-5)  # the scaling did change something


@pytest.mark.parametrize("family", ["qwen3", "llama4_text"])
def test_a_flat_configs_scaling_is_its_rope_parameters(
    families: dict[str, LoadedModel], families_root: Path, family: str
) -> None:
    from transformers import AutoConfig

    folder = families_root / family
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    config.rope_parameters = {"rope_theta": 1e4, **_yarn(4.0)}
    ours, theirs = _loss_pair(
        families[family], eager(folder, config), 2 * CONTEXT, "nonoverlapping", variant="yarn:4"
    )
    assert ours == pytest.approx(theirs, rel=1e-5)


# -- the two config forms -------------------------------------------------------------------


def test_both_config_forms_say_the_same() -> None:
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 4096}
    # Qwen3 with YaRN: transformers 5's rope_parameters, and the older rope_theta + rope_scaling.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    new = model_facts(
        {"model_type": "qwen3", **sizes, "rope_parameters": {"rope_theta": 1e6, **yarn}}
    )
    old = model_facts({"model_type": "qwen3", **sizes, "rope_theta": 1e6, "rope_scaling": yarn})
    assert new == old and new.context == 1024 and new.rotary.base == 1e6
    # Phi-3.5 with longrope's short and long factors, both forms.
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 1024,
    }
    phi_new = model_facts({"model_type": "phi3", **sizes, "rope_parameters": longrope})
    phi_old = model_facts({"model_type": "phi3", **sizes, "rope_scaling": longrope})
    assert phi_new == phi_old and phi_new.context == 1024
    # Gemma 3: per layer type, and the older rope_theta with rope_local_base_freq.
    types = ["sliding_attention"] * 5 + ["full_attention"]
    per_type = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    gemma = {"model_type": "gemma3_text", **sizes, "layer_types": types}
    nested = model_facts({**gemma, "rope_parameters": per_type})
    older = model_facts({**gemma, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert nested.rotary == older.rotary and nested.rotary.base == 1e6
    assert nested.layer_types == older.layer_types == tuple(types)
    assert nested.rope_per_layer_type and not older.rope_per_layer_type


def test_a_folder_written_in_the_older_form_evaluates_the_same(
    families: dict[str, LoadedModel], families_root: Path, tmp_path: Path
) -> None:
    """Qwen3's config.json rewritten with rope_theta at the top and no rope_parameters (the
    form of configs published before transformers 5): the same facts, the same loss."""
    older = tmp_path / "qwen3-older"
    shutil.copytree(families_root / "qwen3", older)
    config = json.loads((older / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    (older / "config.json").write_text(json.dumps(config))
    loaded = load_model("qwen3-older", ModelPolicy(roots=(tmp_path.resolve(),)))
    assert loaded.facts.rotary == families["qwen3"].facts.rotary
    ours, _ = _loss_pair(loaded, eager(older), 16, "nonoverlapping")
    theirs, _ = _loss_pair(families["qwen3"], eager(families_root / "qwen3"), 16, "nonoverlapping")
    assert ours == pytest.approx(theirs, rel=1e-6)


# -- what posbench does not read ------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"rope_parameters": {"rope_theta": 1e4, "rope_kind": "x"}}, "'rope_kind'"),
        ({"rope_parameters": {"rope_type": "su"}}, "rope_type is 'su'"),
        (
            {"rope_parameters": {"hybrid_attention": {"rope_theta": 1e4}}},
            "layer type 'hybrid_attention'",
        ),
        ({"layer_types": ["full_attention", "linear_attention"]}, "'linear_attention'"),
    ],
)
def test_a_field_posbench_does_not_read_refuses_the_model_naming_it(
    extra: dict[str, Any], named: str
) -> None:
    config = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        **extra,
    }
    with pytest.raises(HfModelError) as refused:
        model_facts(config)
    message = str(refused.value)
    assert named in message and "posbench does not read" in message
    assert "\n" not in message


def test_gemma_2_runs_eager_and_refuses_what_needs_sdpa(
    families: dict[str, LoadedModel],
) -> None:
    """Gemma 2 soft-caps its attention logits, which SDPA cannot: it is loaded with eager
    attention (its own numbers), and log-n scaling or the attention probe, which run
    through SDPA, are refused in one line instead of silently dropping the cap."""
    model = families["gemma2"].model
    assert model.hf.config._attn_implementation == "eager" and model.softcap == 50.0
    model.probe = AttentionProbe(CONTEXT)
    try:
        with pytest.raises(HfModelError, match="soft-caps its attention logits"):
            model(torch.zeros(1, 8, dtype=torch.long))
    finally:
        model.probe = None
