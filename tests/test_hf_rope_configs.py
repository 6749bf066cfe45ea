"""RoPE scalings of HuggingFace models against HF transformers' own models on the same
windows (tests/hf_models.py's tiny Llama and GPT-NeoX, weights drawn wide enough that
positions move the loss by tenths of a nat, not millionths).

- A scaling in the checkpoint's own config.json (``rope_parameters``, or the older
  ``rope_scaling``) is the model's own position encoding: posbench's variant ``none``
  evaluated over a whole plan (both protocols, lengths L to 3 L, so sliding windows
  come after longer non-overlapping ones) gives at every point a freshly loaded HF
  model's loss on that point's windows. HF's ``dynamic`` rope keeps the frequencies of
  the longest input it has seen; posbench's evaluation does not carry them over.
- posbench's variants with non-default parameters (YaRN's betas, mscales and truncate,
  Llama 3's band, LongRoPE's per-pair lists), sliding and at a length within L, equal
  the model with those rope parameters written into its config.
- The order probe on such a model is HF's loss on the second half of each window of L
  tokens, with the first half in order, and more with it shuffled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_models import CONTEXT, build_tokenizer, corpus_text, model_config

from core.catalog.hf_models import ModelPolicy
from core.spec import EvalSpec
from worker.data.lm import Corpus, LanguageModelling
from worker.evaluate import evaluate, evaluate_length
from worker.hf.loader import load_model
from worker.hf.tokens import TokenizedLanguageModelling, tokenized
from worker.probes import order_probe

CPU = torch.device("cpu")
WIDE = 0.3  # initializer_range: attention that depends on positions
STRIDE = 8


def save_with_rope(folder: Path, family: str, rope: dict[str, Any], key: str) -> Path:
    """A tiny ``family`` model whose config.json carries ``rope`` (with base 10000) under
    ``key``: transformers 5's ``rope_parameters``, or ``rope_scaling`` beside a top-level
    ``rope_theta`` as checkpoints saved by older transformers have it. A scaling that
    names its original length has max_position_embeddings 4 L, as such checkpoints do."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    longest = 4 * CONTEXT if "original_max_position_embeddings" in rope else CONTEXT
    config = model_config(family, len(tokenizer), tokenizer.eos_token_id, initializer_range=WIDE)
    config.max_position_embeddings = longest
    config.rope_parameters = {**config.rope_parameters, **rope}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    assert saved["rope_parameters"]["rope_type"] == rope["rope_type"]
    if key == "rope_scaling":
        legacy = saved.pop("rope_parameters")
        saved["rope_theta"] = legacy.pop("rope_theta")
        if family == "gpt_neox":
            saved["rotary_pct"] = legacy.pop("partial_rotary_factor")
        saved["rope_scaling"] = legacy
        path.write_text(json.dumps(saved))
    return folder


def text_task(tokenizer: Any) -> TokenizedLanguageModelling:
    task = LanguageModelling("text:tiny.txt")
    stream = np.frombuffer(corpus_text(8).encode("utf-8"), dtype=np.uint8)
    task.corpus = Corpus("text:tiny.txt", "test", stream, stream)
    return tokenized(task, tokenizer)


def fresh_hf(folder: Path, rope: dict[str, Any] | None = None):
    """The saved model as HF transformers loads it (``rope``: these rope parameters
    written into its config instead of its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if rope is not None:
        fraction = config.rope_parameters.get("partial_rotary_factor")
        config.rope_parameters = {
            "rope_theta": 1e4,
            **({"partial_rotary_factor": fraction} if fraction else {}),
            **rope,
        }
    return AutoModelForCausalLM.from_pretrained(
        folder, config=config, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


def their_loss(hf_model, task, spec: EvalSpec, length: int, protocol: str) -> tuple[float, int]:
    """(mean nats, scored tokens) of ``hf_model``'s own logits on the windows posbench
    scores at this point: each window of ``length`` tokens given to the model as it is,
    cross-entropy of the scored targets."""
    nats, count = 0.0, 0
    batches = task.eval_batches(
        length,
        protocol=protocol,
        batch_size=1 << 10,
        tokens=spec.tokens,
        examples=spec.examples,
        stride=spec.stride,
        longest=max(spec.lengths),
    )
    with torch.no_grad():
        for batch in batches:
            logits = hf_model(input_ids=batch.inputs).logits.float()
            losses = F.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none")
            scored = (
                torch.ones_like(losses, dtype=torch.bool) if batch.scored is None else batch.scored
            )
            nats += float(losses[scored].double().sum())
            count += int(scored.sum())
    return nats / count, count


ORIGINAL = {"original_max_position_embeddings": CONTEXT}
OWN_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, **ORIGINAL},
    "longrope": {"rope_type": "longrope", "factor": 4.0, **ORIGINAL},
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        **ORIGINAL,
    },
}


def own_rope(name: str, pairs: int) -> dict[str, Any]:
    rope = dict(OWN_SCALINGS[name])
    if name == "longrope":  # distinct per-pair factors, as Phi-3's
        rope["short_factor"] = [1.0 + 0.1 * k for k in range(pairs)]
        rope["long_factor"] = [2.0 + 0.5 * k for k in range(pairs)]
    return rope


CASES = [
    pytest.param(family, name, key, id=f"{family}-{name}-{key}")
    for family in ("llama", "gpt_neox")
    for name in OWN_SCALINGS
    for key in ("rope_parameters", "rope_scaling")
    if key == "rope_parameters" or family == "llama" or name == "dynamic"
]


@pytest.mark.parametrize(("family", "name", "key"), CASES)
def test_a_scaling_in_the_checkpoints_config_is_honoured_at_every_point_independently(
    tmp_path: Path, family: str, name: str, key: str
) -> None:
    pairs = 8 if family == "llama" else 2
    rope = own_rope(name, pairs)
    save_with_rope(tmp_path / "model", family, rope, key)
    loaded = load_model("model", ModelPolicy(roots=(tmp_path.resolve(),)))
    assert loaded.model.hf.config.rope_parameters["rope_type"] == name
    assert loaded.facts.context == CONTEXT
    task = text_task(loaded.tokenizer)
    # HF's dynamic rope drops what it cached only below L: none of these lengths is.
    lengths = [CONTEXT, 3 * CONTEXT // 2, 3 * CONTEXT]
    spec = EvalSpec(
        lengths=lengths,
        tokens=1 << 20,
        protocols=["nonoverlapping", "sliding"],
        stride=STRIDE,
        variants=["none"],
    )
    rows = evaluate(loaded.model, task, spec, train_length=CONTEXT, scalable=True, device=CPU)
    # The plan goes variant, protocol, length: sliding's short lengths come after 3 L.
    assert [(r.protocol, r.length) for r in rows] == [
        (protocol, length) for protocol in spec.protocols for length in lengths
    ]
    folder = tmp_path / "model"
    for row in rows:
        loss, count = their_loss(fresh_hf(folder), task, spec, row.length, row.protocol)
        assert row.tokens == count > 0
        assert row.loss == pytest.approx(loss, abs=1e-5), (row.protocol, row.length)
    if name == "dynamic":
        # The test tells the difference: HF's own model, run at 3 L first, is another model.
        spent = fresh_hf(folder)
        their_loss(spent, task, spec, 3 * CONTEXT, "nonoverlapping")
        stale, _ = their_loss(spent, task, spec, 3 * CONTEXT // 2, "sliding")
        fresh = next(r for r in rows if (r.protocol, r.length) == ("sliding", 3 * CONTEXT // 2))
        assert abs(stale - fresh.loss) > 1e-3


# posbench variants with parameters off their defaults; HF's rope parameters have the
# same names.
PARAMETERS = {
    "yarn": {
        "beta_fast": 8.0,
        "beta_slow": 2.0,
        "truncate": False,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "llama3": {"low_freq_factor": 2.0, "high_freq_factor": 8.0},
    "longrope": {
        "short_factor": [1.0 + 0.1 * k for k in range(8)],
        "long_factor": [2.0 + 0.5 * k for k in range(8)],
    },
}


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plain")
    return save_with_rope(root / "llama", "llama", {"rope_type": "default"}, "rope_parameters")


@pytest.mark.parametrize("method", list(PARAMETERS))
@pytest.mark.parametrize("length", [CONTEXT // 2, 2 * CONTEXT])
def test_scaling_parameters_off_their_defaults_are_the_models_with_them_in_config(
    plain_llama: Path, method: str, length: int
) -> None:
    params = PARAMETERS[method]
    loaded = load_model("llama", ModelPolicy(roots=(plain_llama.parent.resolve(),)))
    task = text_task(loaded.tokenizer)
    spec = EvalSpec(
        lengths=[length],
        tokens=1 << 20,
        protocols=["sliding"],
        stride=STRIDE,
        variants=[{"method": method, "factor": 4, **params}],
    )
    variant = spec.variants[-1]
    assert variant.params == params
    row = evaluate_length(
        loaded.model,
        task,
        spec,
        length=length,
        protocol="sliding",
        variant=variant,
        train_length=CONTEXT,
        device=CPU,
    )
    rope = {"rope_type": method, "factor": 4.0, **params, **ORIGINAL}
    loss, count = their_loss(fresh_hf(plain_llama, rope), task, spec, length, "sliding")
    assert row.tokens == count > 0
    assert row.loss == pytest.approx(loss, abs=1e-5)
    plain, _ = their_loss(loaded.model.hf, task, spec, length, "sliding")
    assert abs(row.loss - plain) > 1e-3  # the scaling changes the model, within L too


def test_the_order_probe_of_an_hf_model_is_its_loss_with_the_distant_half_shuffled(
    plain_llama: Path,
) -> None:
    """The order probe (on by default) on an hf: model: windows of L of the model's
    tokens, the second half scored, with the first half in order and shuffled."""
    loaded = load_model("llama", ModelPolicy(roots=(plain_llama.parent.resolve(),)))
    task = text_task(loaded.tokenizer)
    tokens = 4 * CONTEXT
    probe = order_probe(loaded.model, task, CONTEXT, tokens=tokens, batch_size=8, device=CPU)
    half = CONTEXT // 2
    nats, count = 0.0, 0
    windows = task.eval_batches(
        CONTEXT, protocol="nonoverlapping", batch_size=8, tokens=tokens, examples=1
    )
    with torch.no_grad():
        for batch in windows:
            logits = loaded.model.hf(input_ids=batch.inputs).logits.float()[:, half:]
            targets = batch.targets[:, half:]
            nats += float(F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum"))
            count += targets.numel()
    assert probe.tokens == count == tokens // 2
    assert probe.ordered_loss == pytest.approx(nats / count, abs=1e-5)
    assert probe.sensitivity > 1e-3  # this model reads order: shuffling costs it
    assert probe.as_summaries()["order_sensitivity"] == probe.sensitivity
