"""Attention diagnostics and log-n scaling of hf: models against HF transformers itself:
every diagnostic from the model's own eager attention (``output_attentions=True``), and
Qwen-style log-n scaling as Qwen's code writes it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hf_models import CONTEXT, FAMILIES, MORE_ROPE, NEW_FAMILIES, save_model

from core.catalog.hf_models import ModelPolicy
from worker.diagnostics import STATS, AttentionProbe, sampled_queries
from worker.hf.loader import LoadedModel, load_model

L = 20  # the training length the diagnostics measure from (below the models' context)
# The 2025-26 families the probe reads (Gemma 2 soft-caps its logits: refused, its test
# in test_hf_families.py), their windows and chunks included.
PROBED = tuple(family for family in NEW_FAMILIES if family != "gemma2")


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for family in (*FAMILIES, *MORE_ROPE, *PROBED):
        save_model(root / family, family, context=CONTEXT)
    return root


@pytest.fixture(scope="module")
def loaded(models_root: Path) -> dict[str, LoadedModel]:
    policy = ModelPolicy(roots=(models_root.resolve(),))
    return {family: load_model(family, policy) for family in (*FAMILIES, "qwen2", *PROBED)}


def _eager(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()


def _eager_logits(model, tokens: torch.Tensor, monkeypatch):
    """HF's eager attention probabilities of each layer (``output_attentions=True``), and
    its pre-softmax logits [B, H, T, T]: the query and key eager attention receives
    (rotated, Llama 4's NoPE layers' temperature included) times the module's scaling,
    masked where the layer's own mask hides a key (the future, a window, a chunk)."""
    import importlib

    seen: list[torch.Tensor] = []

    def keeping(original):
        def keep(module, query, key, value, attention_mask, scaling=None, **kwargs):
            groups = query.shape[1] // key.shape[1]
            keys = key.repeat_interleave(groups, dim=1)
            logits = torch.matmul(query, keys.transpose(-1, -2)) * scaling
            length = query.shape[-2]
            hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
            if attention_mask is not None:  # additive: HF's most negative float where hidden
                hidden = hidden | (attention_mask[..., :length, :length] < -1e30)
            seen.append(logits.masked_fill(hidden, float("-inf")))
            return original(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

        return keep

    names = ("gpt2", "gpt_neox", "llama", "qwen2", "qwen3", "gemma3", "phi3", "cohere2")
    names += ("olmo2", "smollm3", "llama4")
    modules = [importlib.import_module(f"transformers.models.{n}.modeling_{n}") for n in names]
    for module in modules:
        monkeypatch.setattr(
            module, "eager_attention_forward", keeping(module.eager_attention_forward)
        )
    with torch.no_grad():
        attentions = model(tokens, output_attentions=True, use_cache=False).attentions
    monkeypatch.undo()
    return list(attentions), seen


def _reference(probabilities: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor):
    """Per head, each statistic (STATS order) of the rows' attention from HF's own
    probabilities (and logits, for the largest; the keys a query sees, where they are
    finite, for the normalised entropy)."""
    p = probabilities[:, :, rows].double()
    seen = torch.isfinite(logits[:1, :1, rows]).sum(-1).double()[0, 0]  # [Q]
    keys = torch.arange(p.shape[-1])
    distance = (rows[:, None] - keys[None, :]).clamp(min=0).double()
    entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    stats = torch.stack(
        (
            entropy,
            torch.where(seen > 1, entropy / seen.clamp(min=2).log(), 0.0),
            (p * distance).sum(-1),
            p[..., :4].sum(-1),
            (p * (distance >= L)).sum(-1),
            logits[:, :, rows].double().amax(-1),
        ),
        dim=-1,
    )
    return stats.mean(dim=(0, 2))  # [H, STATS]


@pytest.mark.parametrize("family", [*FAMILIES, "qwen2", *PROBED])
def test_each_diagnostic_is_the_one_of_hf_transformers_eager_attention(
    family: str, loaded: dict[str, LoadedModel], models_root: Path, monkeypatch
) -> None:
    model = loaded[family].model
    length = CONTEXT if family == "gpt2" else 3 * CONTEXT  # GPT-2's table ends at CONTEXT
    tokens = torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(7))
    probe = AttentionProbe(train_length=L, sample=16)
    with torch.no_grad():
        plain = model(tokens)
        model.probe = probe
        try:
            probed = model(tokens)
        finally:
            model.probe = None
    assert torch.equal(plain, probed)  # the probe changes nothing the model computes
    found = probe.result()
    probabilities, logits = _eager_logits(_eager(models_root / family), tokens, monkeypatch)
    assert len(logits) == len(probabilities) == found.per_head.shape[0]
    rows = sampled_queries(length, 16)
    assert found.queries == 2 * len(rows)
    for layer, (p, z) in enumerate(zip(probabilities, logits, strict=True)):
        expected = _reference(p, z, rows)
        for i, stat in enumerate(STATS):
            torch.testing.assert_close(
                found.per_head[layer, :, i], expected[:, i], atol=1e-5, rtol=0, msg=stat
            )
    assert found.summary()["beyond_mass"] > 0  # queries past L reach past it


def test_log_n_on_a_llama_is_qwens_query_scaling(
    loaded: dict[str, LoadedModel], models_root: Path, monkeypatch
) -> None:
    """posbench's logn on an HF Llama equals the model with Qwen's rule written into its
    attention: the query at position i (1-based) times log_L(i) past L (Qwen's
    ``logn_list``), and changes nothing up to L."""
    from transformers.models.llama import modeling_llama

    model = loaded["llama"].model
    tokens = torch.randint(0, 300, (2, 3 * CONTEXT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(tokens)
        plain_short = model(tokens[:, :L])
        model.logn_length = L
        try:
            scaled = model(tokens)
            short = model(tokens[:, :L])
        finally:
            model.logn_length = None
    assert torch.equal(short, plain_short)  # n <= L everywhere: bit-identical

    logn_list = [math.log(i, L) if i > L else 1.0 for i in range(1, 3 * CONTEXT + 1)]
    rotate = modeling_llama.apply_rotary_pos_emb

    def qwen(q, k, cos, sin, *args, **kwargs):
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        factors = torch.tensor(logn_list[: q.shape[-2]], dtype=q.dtype)
        return q * factors[:, None], k

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", qwen)
    reference = _eager(models_root / "llama")
    with torch.no_grad():
        expected = reference(tokens, use_cache=False).logits
    torch.testing.assert_close(scaled, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scaled[:, :L], plain[:, :L], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scaled[:, L:], plain[:, L:], atol=1e-4)
