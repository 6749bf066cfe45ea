"""A study of an hf: model (``model: {hf: NAME}``) from the spec to the database: the
spec's own rules, the operator's rules (the models roots, the hub switch and its
allow-list) checked at submit and by ``posbench run`` with exit 2 and nothing written,
what a config says about a model's positions, and a study through ``posbench run``, the
result files and ``posbench import``, and through the service's queue and a worker."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import isolated_env, posbench_cli
from hf_models import CONTEXT, FAMILIES, corpus_text, save_model

from core.catalog.hf_models import HfModelError, ModelPolicy, local_facts, model_facts
from core.spec import SpecError, parse_spec
from core.spec.hf import model_source_problem, with_model_length


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A posbench home with the tiny models under models/ and a corpus under corpora/."""
    folder = tmp_path_factory.mktemp("home")
    for family in FAMILIES:
        save_model(folder / "models" / family, family)
    (folder / "corpora").mkdir()
    (folder / "corpora" / "tiny.txt").write_text(corpus_text(60))
    return folder


def policy(home: Path, **values: Any) -> ModelPolicy:
    return ModelPolicy(roots=((home / "models").resolve(),), **values)


def spec(hf: str = "llama", **changes: Any) -> dict[str, Any]:
    base = {
        "name": "hf study",
        "model": {"hf": hf},
        "task": {"name": "lm", "corpus": "text:tiny.txt"},
        "train": {"length": CONTEXT},
        "eval": {"lengths": [16, 32, 64], "tokens": 128, "order_probe": False},
    }
    return {**base, **changes}


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    return str(caught.value)


# -- the spec -------------------------------------------------------------------------------


def test_an_hf_study_is_one_run_of_the_model_evaluated_as_it_is() -> None:
    study = parse_spec(spec(eval={"variants": ["yarn:auto"]}))
    (run,) = study.runs()
    assert run.encoding.name == "hf" and run.encoding.label == "hf:llama"
    assert run.encoding.resolved_params == {"model": "llama"} and run.train_hash is None
    assert study.train.steps == 0 and study.encodings == []
    assert study.eval.lengths == [32, 64, 128, 256]  # 1, 2, 4, 8 x the model's context
    assert study.training_flops() == 0 and study.estimated_checkpoint_bytes() == 0
    # Its evaluation is counted at the size its config describes (audit F1: it was 0).
    assert study.eval_flops((10**9, 24, 2048)) > 2 * 10**9 * study.eval_tokens()
    # The stored spec (every default written out) is the same study, the same run.
    again = parse_spec(study.model_dump(mode="json"))
    assert again == study and again.runs() == study.runs()
    other = parse_spec(spec("./llama"))
    assert other.runs()[0].config_hash != run.config_hash


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train": {}}, "train.length is required with a hub model.hf"),
        ({"model": {"hf": "llama", "d_model": 256}}, "give either hf or d_model, not both"),
        ({"model": {"hf": "llama", "preset": "tiny"}}, "give either hf or"),
        ({"model": {"hf": " "}}, "model.hf must be a printable folder name"),
        ({"encodings": ["rope"]}, "model.hf brings its own position encoding"),
        ({"train": {"length": 32, "steps": 10}}, "train.steps: model.hf is evaluated as it is"),
        ({"train": {"length": 32, "lr": 0.1}}, "train.lr: model.hf is evaluated as it is"),
        ({"seeds": [0, 1]}, "model.hf is evaluated once"),
        (
            {"task": "passkey", "eval": {"lengths": [64]}},
            "task 'passkey' needs sequences of at least 128 tokens; eval.lengths is 64",
        ),
        ({"eval": {"variants": ["yarn:2+ft10"]}}, "'yarn:2+ft10' fine-tunes"),
        (
            {"eval": {"lengths": [16], "protocols": ["decode"], "order_probe": False}},
            "'decode' runs posbench's own KV cache (worker.decode) on posbench models",
        ),
    ],
)
def test_the_spec_refuses_what_an_hf_model_cannot_do(changes: dict, message: str) -> None:
    assert message in refused(spec(**changes))


def test_a_trained_study_keeps_its_bounds() -> None:
    trained = {"encodings": ["rope"], "train": {"length": 20_000, "steps": 0}}
    problem = refused(trained)
    assert "train.steps = 0: must be greater than or equal to 1" in problem
    assert "train.length = 20000: must be less than or equal to 16384" in problem
    # An hf: model's context may be longer than posbench trains.
    assert parse_spec(spec(train={"length": 32_768}, eval={"lengths": [32_768]}))


# -- what a config says ---------------------------------------------------------------------


def test_the_facts_of_each_family_from_its_saved_config(home: Path) -> None:
    rules = policy(home)
    _, gpt2 = local_facts("gpt2", rules)
    assert (gpt2.encoding, gpt2.context, gpt2.max_positions, gpt2.rotary) == (
        "learned",
        CONTEXT,
        CONTEXT,
        None,
    )
    _, neox = local_facts("gpt_neox", rules)
    assert neox.scalable and neox.rotary.rotary_dim == 4 and neox.partial_rotary_factor == 0.25
    located, llama = local_facts("./llama", rules)
    assert located.folder == (home / "models" / "llama").resolve()
    assert llama.rotary.rotary_dim == 16 and llama.rotary.base == 10000.0
    assert llama.context == CONTEXT and llama.context_key == "max_position_embeddings"


def test_older_configs_and_scaled_ones_say_the_same_things() -> None:
    # Pythia's config.json as published (transformers 4): rotary_pct, rotary_emb_base.
    pythia = model_facts(
        {
            "model_type": "gpt_neox",
            "hidden_size": 512,
            "num_attention_heads": 8,
            "max_position_embeddings": 2048,
            "rotary_pct": 0.25,
            "rotary_emb_base": 10000,
        }
    )
    assert (pythia.rotary.rotary_dim, pythia.context) == (16, 2048)
    # Llama 3.1: its rope scaling names the original context the scalings measure from.
    llama31 = model_facts(
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 8192},
        }
    )
    assert llama31.context == 8192 and llama31.rotary.base == 500000.0
    assert llama31.rotary.rotary_dim == 128
    with pytest.raises(HfModelError, match="model_type 'bert' is not one posbench evaluates"):
        model_facts({"model_type": "bert"})


# -- the operator's rules, at submit --------------------------------------------------------


def test_a_scaling_on_a_model_without_rope_is_refused(home: Path) -> None:
    study = parse_spec(spec("gpt2", eval={"lengths": [32], "variants": ["yarn:auto"]}))
    problem = model_source_problem(study, policy(home))
    assert "'yarn:auto' scales RoPE; the model is gpt2" in problem and "without RoPE" in problem


def test_the_training_length_must_be_the_models_context(home: Path) -> None:
    study = parse_spec(spec(train={"length": 64}))
    problem = model_source_problem(study, policy(home))
    assert problem == (
        "train.length = 64, but the model's config says its original context is 32 "
        "(max_position_embeddings); give train.length: 32"
    )
    assert model_source_problem(parse_spec(spec()), policy(home)) is None


def test_a_path_outside_the_models_roots_is_refused_without_being_named(
    home: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    save_model(outside, "llama")
    for name in (str(outside), str(tmp_path / "missing"), "../corpora"):
        problem = model_source_problem(parse_spec(spec(name)), policy(home))
        assert problem is not None and str(tmp_path) not in problem
        assert "models roots" in problem or "'..'" in problem
    # A link inside a model folder that leaves the roots.
    (home / "models" / "linked").mkdir()
    (home / "models" / "linked" / "config.json").write_text(
        (home / "models" / "llama" / "config.json").read_text()
    )
    (home / "models" / "linked" / "model.safetensors").symlink_to(outside / "model.safetensors")
    problem = model_source_problem(parse_spec(spec("linked")), policy(home))
    assert problem.endswith("model.safetensors links outside the models roots")
    assert str(outside) not in problem


def test_hub_models_need_the_operators_switch_and_allow_list(home: Path) -> None:
    study = parse_spec(spec("EleutherAI/pythia-70m", train={"length": 2048}))
    off = model_source_problem(study, policy(home))
    assert "hub models are off here" in off and "POSBENCH_HF_DATASETS=true" in off
    listed = policy(home, hub_enabled=True, hub_allow=("gpt2",))
    assert "not in the operator's allow-list (POSBENCH_HF_ALLOW: gpt2)" in model_source_problem(
        study, listed
    )
    # Allowed: its config is checked on the worker, once it has it.
    assert model_source_problem(study, policy(home, hub_enabled=True)) is None


# -- posbench run, the results and import ---------------------------------------------------


def env(home: Path, **extra: str) -> dict[str, str]:
    return isolated_env(
        home,
        POSBENCH_MODELS_ROOTS=str(home / "models"),
        POSBENCH_CORPUS_ROOTS=str(home / "corpora"),
        POSBENCH_DEVICE="cpu",
        **extra,
    )


# LongRoPE's per-pair lists must have one value per pair the model rotates (Llama: 8).
SHORT_LONGROPE = {"method": "longrope", "factor": 2, "short_factor": [1.0, 1.5, 2.0]}
WRONG_PAIRS = "short_factor has 3 values; a model rotating 16 dimensions has 8 pairs and needs 8"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": {"hf": "gpt2"}, "eval": {"lengths": [32], "variants": ["pi:2"]}}, "RoPE"),
        # YaRN's note (its fastest pair) would be noise beside the refusal: none is shown.
        ({"model": {"hf": "gpt2"}, "eval": {"lengths": [32], "variants": ["yarn:4"]}}, "RoPE"),
        ({"model": {"hf": "/etc"}}, "not inside the models roots"),
        ({"model": {"hf": "gpt2-xl"}, "train": {"length": 1024}}, "hub models are off here"),
        ({"eval": {"lengths": [64], "variants": [SHORT_LONGROPE]}}, WRONG_PAIRS),
    ],
)
def test_posbench_run_refuses_with_exit_2_and_writes_nothing(
    home: Path, tmp_path: Path, changes: dict, message: str
) -> None:
    spec_file = tmp_path / "study.json"
    spec_file.write_text(json.dumps(spec(**changes)))
    out = tmp_path / "out"
    done = posbench_cli("run", str(spec_file), "--out", str(out), env=env(home))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and not out.exists()
    assert "note:" not in done.stderr  # a refused spec shows its refusal alone


def test_posbench_submit_refuses_before_any_note(home: Path, tmp_path: Path) -> None:
    spec_file = tmp_path / "study.json"
    variants = {"lengths": [32], "variants": ["yarn:4"]}
    spec_file.write_text(json.dumps(spec(model={"hf": "gpt2"}, eval=variants)))
    assert posbench_cli("db", "upgrade", env=env(home)).returncode == 0
    done = posbench_cli("submit", str(spec_file), env=env(home))
    assert done.returncode == 2 and "without RoPE" in done.stderr, done.stderr
    assert "note:" not in done.stderr


def test_posbench_run_evaluates_the_model_and_import_stores_it(home: Path, tmp_path: Path) -> None:
    spec_file = tmp_path / "study.json"
    study = spec(
        eval={
            "lengths": [16, 32, 64],
            "tokens": 128,
            "protocols": ["nonoverlapping", "sliding"],
            "stride": 8,
            "variants": ["yarn:auto"],
        }
    )
    assert parse_spec(study).eval.order_probe  # on by default, as the dashboard submits it
    spec_file.write_text(json.dumps(study))
    out = tmp_path / "out"
    done = posbench_cli(
        "run", str(spec_file), "--json", "--out", str(out), env=env(home), timeout=600
    )
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    assert (run["label"], run["encoding"], run["train"]["steps"]) == ("hf:llama", "hf", 0)
    points = {(e["variant"], e["protocol"], e["length"]): e for e in run["evaluations"]}
    assert len(points) == 2 * 2 * 3
    for point in points.values():
        assert point["bits_per_byte"] < point["loss"] / math.log(2)  # tokens span bytes
        assert point["tokens"] > 0 and point["not_applicable"] is None
    model = run["provenance"]["model"]
    assert model["model_type"] == "llama" and len(model["weights_sha256"]) == 64
    assert model["transformers_version"] and model["validation_bytes"] > 0
    summaries = {(s["variant"], s["name"]): s["value"] for s in run["summaries"]}
    assert ("none", "ratio_2x") in summaries
    # The order probe ran on the model's windows of train.length tokens.
    ordered, shuffled = (
        summaries["none", "order_ordered_loss"],
        summaries["none", "order_shuffled_loss"],
    )
    assert ordered > 0 and shuffled > 0  # what it measures: tests/test_hf_rope_configs.py
    assert summaries["none", "order_sensitivity"] == pytest.approx(shuffled - ordered)
    # The results file is imported like any other.
    from core.settings import Settings
    from jobs.transfer.importer import import_results

    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/db.sqlite")
    from db.migrate import upgrade

    upgrade(settings.database)
    imported = import_results(out / "results.json", settings=settings, actor="tester")
    assert imported.runs == 1 and imported.evaluations == 12
    from db import queries

    stored = queries.run_summaries(settings.database, [imported.study_id])
    probe = stored[stored["summary"].str.startswith("order_")]
    assert dict(zip(probe["summary"], probe["value"], strict=True)) == pytest.approx(
        {name: value for (_, name), value in summaries.items() if name.startswith("order_")}
    )


# -- the service: submit, the queue, a worker, the database --------------------------------


@pytest.fixture
def worker_settings(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The settings a worker reads (get_settings), with the models and corpus roots."""
    from core import settings as settings_module
    from db.migrate import upgrade

    values = env(home, POSBENCH_DATABASE_URL=f"sqlite:///{tmp_path}/test.db")
    values["POSBENCH_HOME"] = str(tmp_path)
    for name, value in values.items():
        if name.startswith("POSBENCH_"):
            monkeypatch.setenv(name, value)
    settings_module.get_settings.cache_clear()
    config = settings_module.get_settings()
    upgrade(config.database)
    yield config
    settings_module.get_settings.cache_clear()


def export_to_mlflow(url: str, study_id: int, model: dict, folder: Path) -> None:
    from mlflow.tracking import MlflowClient

    from jobs.transfer.mlflow_export import to_mlflow

    tracking = (folder / "mlruns").as_uri()
    to_mlflow(url, study_id, tracking_uri=tracking, experiment="hf")
    client = MlflowClient(tracking_uri=tracking)
    (exported,) = [
        r
        for r in client.search_runs([client.get_experiment_by_name("hf").experiment_id])
        if "posbench.variant" not in r.data.tags
    ]
    tags = exported.data.tags
    assert tags["posbench.model.hf"] == "llama"
    assert tags["posbench.model.weights_sha256"] == model["weights_sha256"]
    assert exported.data.params["model.hf"] == "llama"
    history = client.get_metric_history(
        exported.info.run_id, "eval/bits_per_byte/none/nonoverlapping"
    )
    assert sorted(m.step for m in history) == [16, 32, 64]


def test_a_study_goes_through_the_queue_a_worker_and_the_database(
    worker_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from core.status import RunStatus
    from db import queries
    from jobs import lifecycle
    from jobs.service import Refused, submit
    from worker.runtime.execute import execute

    url = worker_settings.database
    sent: list[int] = []
    submitted = submit(
        parse_spec(spec()), actor="tester", settings=worker_settings, send=sent.append
    )
    assert sent == submitted.queued and len(sent) == 1
    claimed = lifecycle.claim(url, sent[0], "node")
    assert execute(claimed, "node") == RunStatus.DONE.value
    (run,) = queries.runs(url, submitted.study_id).to_dict("records")
    assert (run["label"], run["encoding"], run["total_steps"]) == ("hf:llama", "hf", 0)
    assert run["checkpoint_uri"] is None
    assert run["provenance"]["model"]["position_encoding"] == "rope"
    curve = queries.curves(url, [submitted.study_id])
    assert sorted(curve["eval_length"]) == [16, 32, 64]
    assert curve["bits_per_byte"].notna().all() and (curve["bits_per_byte"] > 0).all()
    # Exported to MLflow like any other run: its curves, and which model it was.
    export_to_mlflow(url, submitted.study_id, run["provenance"]["model"], tmp_path)
    # The same model and evaluation again: the result cache serves it.
    again = submit(parse_spec(spec()), actor="tester", settings=worker_settings, send=sent.append)
    assert again.reused and not again.queued
    # Refused before anything is stored: a model outside the roots.
    with pytest.raises(Refused, match="not inside the models roots"):
        submit(parse_spec(spec("/etc")), actor="tester", settings=worker_settings, send=sent.append)
    wrong = parse_spec(spec(eval={"lengths": [64], "variants": [SHORT_LONGROPE]}))
    with pytest.raises(Refused, match=WRONG_PAIRS):
        submit(wrong, actor="tester", settings=worker_settings, send=sent.append)
    assert len(queries.runs(url)) == 2


def test_a_folder_s_config_gives_the_training_length(home: Path, tmp_path: Path) -> None:
    # No train.length: the config's max_position_embeddings (Llama) is used, and said.
    data = {k: v for k, v in spec().items() if k != "train"}
    filled, told = with_model_length(data, policy(home))
    assert filled["train"] == {"length": CONTEXT}
    assert told == (
        f"train.length = {CONTEXT}, the model's original context, from its config's "
        "max_position_embeddings (give train.length to override it)"
    )
    # Given, it is kept (and checked against the config as before); a hub id is left to
    # the worker, which reads its config.
    assert with_model_length(spec(), policy(home)) == (spec(), None)
    hub = {**data, "model": {"hf": "EleutherAI/pythia-70m"}}
    assert with_model_length(hub, policy(home)) == (hub, None)
    spec_file = tmp_path / "study.json"
    spec_file.write_text(json.dumps({**data, "eval": {"lengths": [16], "tokens": 64}}))
    done = posbench_cli("run", str(spec_file), "--out", str(tmp_path / "out"), env=env(home))
    assert done.returncode == 0, done.stderr
    assert f"note: train.length = {CONTEXT}, the model's original context" in done.stderr
