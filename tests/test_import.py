"""posbench import: a study run with `posbench run` joins the results database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli, study_results

from core.settings import Settings, get_settings
from core.spec import parse_spec
from db import queries
from db.migrate import upgrade
from jobs.service import submit
from jobs.transfer.importer import ImportProblem, import_results
from worker.run import prepared_task, resolve_device, run_study

SPEC = {
    "name": "laptop",
    "model": "tiny",
    "train": {"length": 16, "steps": 6, "batch_size": 2, "val_every": 3},
    "encodings": ["rope", "alibi"],
    "eval": {"lengths": [16, 32], "tokens": 256, "variants": ["yarn:2"]},
}


@pytest.fixture(scope="module")
def payload() -> dict:
    return study_results(SPEC)


# A fine-tuned variant (rope only: alibi is not rotary), its curve a point a step.
TUNED = {
    **SPEC,
    "name": "tuned",
    "train": {**SPEC["train"], "progress_every": 1},
    "eval": {**SPEC["eval"], "variants": ["yarn:2+ft3"]},
}


@pytest.fixture(scope="module")
def tuned_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The results.json a real `posbench run` of TUNED wrote."""
    folder = tmp_path_factory.mktemp("tuned")
    spec = folder / "tuned.json"
    spec.write_text(json.dumps(TUNED))
    env = isolated_env(folder / "home")
    done = posbench_cli("run", str(spec), "--out", str(folder / "out"), env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return folder / "out" / "results.json"


def _retuned(payload: dict, steps: int) -> dict:
    """The TUNED file as if its variant were fine-tuned for ``steps`` steps: relabelled
    everywhere, with the config hashes this version computes for that spec."""
    old, new = json.dumps("yarn:2+ft3"), json.dumps(f"yarn:2+ft{steps}")
    edited = json.loads(json.dumps(payload).replace(old, new))
    edited["spec"]["eval"]["variants"][1]["finetune"]["steps"] = steps
    hashes = {(r.encoding.label, r.seed): r.config_hash for r in parse_spec(edited["spec"]).runs()}
    for run in edited["runs"]:
        run["config_hash"] = hashes[(run["label"], run["seed"])]
    return edited


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    config = Settings(home=tmp_path / "home")
    upgrade(config.database)
    return config


def posbench(settings: Settings, *args: str):
    return posbench_cli(*args, env=isolated_env(settings.home, COLUMNS="200"))


def write(tmp_path: Path, payload: dict, name: str = "results.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(payload))
    return path


def test_a_local_study_is_imported_whole_and_reused(
    settings: Settings, payload: dict, tmp_path: Path
) -> None:
    path = write(tmp_path, payload)
    done = posbench(settings, "import", str(path))
    assert done.returncode == 0, done.stderr
    assert "imported study 1 (laptop): 2 runs, 6 evaluations" in done.stdout
    runs = queries.runs(settings.database, study_id=1)
    assert list(runs["label"]) == ["rope", "alibi"] and set(runs["status"]) == {"done"}
    assert all(p["imported_from"] == str(path) for p in runs["provenance"])
    assert set(runs["imported_from"]) == {str(path)}
    # The numbers are the file's, point for point.
    curves = queries.curves(settings.database, study_ids=[1]).set_index(
        ["label", "variant", "eval_length"]
    )
    for run in payload["runs"]:
        for row in run["evaluations"]:
            stored = curves.loc[(run["label"], row["variant"], row["length"])]
            assert stored["perplexity"] == pytest.approx(row["perplexity"])
    points = queries.train_points(settings.database, runs["id"].tolist())
    assert sorted(points["step"].unique()) == [
        p["step"] for p in payload["runs"][0]["train"]["curve"]
    ]
    assert points["val_loss"].notna().sum() == 2 * 2  # steps 3 and 6, two runs
    summaries = queries.run_summaries(settings.database, [1])
    assert len(summaries) == sum(len(r["summaries"]) for r in payload["runs"])
    shown = posbench(settings, "results", "--study", "1")
    assert shown.returncode == 0 and "yarn:2" in shown.stdout
    # A later submit of the same study trains: imported numbers are not reused as if
    # they were trained here, unless the submitter asks.
    again = submit(parse_spec(SPEC), settings=settings, send=lambda run_id: None, actor="tester")
    assert len(again.queued) == 2 and again.reused == [] and again.imported == []
    asked = submit(
        parse_spec(SPEC),
        settings=settings,
        send=lambda run_id: None,
        reuse_imported=True,
        actor="tester",
    )
    assert asked.queued == [] and asked.reused == asked.imported and len(asked.reused) == 2
    reused = queries.runs(settings.database, study_id=asked.study_id)
    assert set(reused["imported_from"]) == {str(path)}
    # Importing it twice is refused; --force stores a second copy.
    twice = posbench(settings, "import", str(path))
    assert twice.returncode == 2
    assert "its results are already stored (run 1 of study 1 has the same config hash)" in (
        twice.stderr
    )
    forced = posbench(settings, "import", str(path), "--force")
    assert forced.returncode == 0 and "imported study 4" in forced.stdout


def _edited(payload: dict, change) -> dict:
    copy = json.loads(json.dumps(payload))
    change(copy)
    return copy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.pop("runs"), "runs: Field required"),
        (lambda p: p.update(runs=[]), "runs: List should have at least 1 item"),
        (
            lambda p: p["spec"]["train"].update(length=4),
            "its spec: train.length = 4: must be greater than or equal to 8",
        ),
        (  # audit F6: it became a live link in Compare's legend
            lambda p: p["spec"].update(model={"hf": "<a href=https://evil>click</a>"}),
            "model.hf may not contain < >",
        ),
        (
            lambda p: p["runs"][1].update(config_hash="0" * 24),
            "runs[1] (alibi, seed 0) is not a run of its spec as this posbench version hashes",
        ),
        (lambda p: p["runs"].append(p["runs"][0]), "runs[2] (rope) appears twice"),
        (
            lambda p: p["runs"][0]["evaluations"].append(p["runs"][0]["evaluations"][0]),
            "runs[0].evaluations: ('none', 'nonoverlapping', 16) appears twice",
        ),
        (
            lambda p: p["runs"][0]["train"]["curve"][0].update(loss="low"),
            "runs.0.train.curve.0.loss: Input should be a valid number",
        ),
        (lambda p: p["runs"].pop(1), "its spec has 2 runs, the file 1; missing: alibi seed 0"),
        (
            lambda p: p["runs"][0]["train"].update(steps=3),
            "runs[0] (rope, seed 0) trained 3 of 6 steps",
        ),
        (
            lambda p: p["runs"][0]["evaluations"].pop(),
            "runs[0] (rope, seed 0): evaluation ('yarn:2', 'nonoverlapping', 32) is missing",
        ),
        (
            lambda p: p["runs"][1]["evaluations"][0].update(variant="yarn:2"),
            "runs[1] (alibi, seed 0): evaluation ('yarn:2', 'nonoverlapping', 16) is not in",
        ),
        (  # audit G6: every Compare page of the study sent the 5 MB reason to its viewer
            lambda p: _not_applicable(p, "x" * (5 << 20)),
            "runs.0.evaluations.0.not_applicable: String should have at most 500 characters",
        ),
        (
            lambda p: _not_applicable(p, "past the table\x1b[2J"),
            "runs.0.evaluations.0.not_applicable: Value error, must be one line of printable",
        ),
        (
            lambda p: p["runs"][0].update(label="rope\nforged line"),
            "runs.0.label: Value error, must be one line of printable characters",
        ),
    ],
)
def test_a_broken_file_is_refused_and_nothing_is_written(
    settings: Settings, payload: dict, tmp_path: Path, change, message: str
) -> None:
    done = posbench(settings, "import", str(write(tmp_path, _edited(payload, change))))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert queries.studies(settings.database).empty


def _not_applicable(payload: dict, reason: str) -> None:
    row = payload["runs"][0]["evaluations"][0]
    for name in ("loss", "perplexity", "bits_per_byte", "accuracy", "token_accuracy"):
        row[name] = None
    row["not_applicable"] = reason


def test_every_free_string_of_the_results_schema_is_bounded_printable_text() -> None:
    """The class stays closed: a str field added to any record of results.json without
    the bounded Text type fails here."""
    import dataclasses
    import types
    import typing

    from core import results_schema

    records = [
        value
        for value in vars(results_schema).values()
        if dataclasses.is_dataclass(value) and value.__module__ == results_schema.__name__
    ]
    assert len(records) >= 6
    unbounded = []
    for record in records:
        for name, hint in typing.get_type_hints(record, include_extras=True).items():
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            for part in typing.get_args(hint) if union else [hint]:
                if part is str:
                    unbounded.append(f"{record.__name__}.{name}")
    assert unbounded == []
    assert results_schema.bounded_text("a\x1b[2J\nsecond") == "a?[2J"
    assert len(results_schema.bounded_text("y" * 10_000)) == results_schema.MAX_TEXT


def _first(p: dict, variant: str = "none") -> dict:
    return next(e for e in p["runs"][0]["evaluations"] if e["variant"] == variant)


def _summary(p: dict, **values) -> None:
    summaries = p["runs"][0]["summaries"]
    probe = next((s for s in summaries if s["name"] == "order_sensitivity"), None)
    if probe is None:
        probe = {"variant": "none", "protocol": "any", "name": "order_sensitivity"}
        summaries.append(probe)
    probe.update(values)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: _first(p).update(perplexity=None), "has no perplexity"),
        (lambda p: _first(p).update(loss=None), "has no loss"),
        (
            lambda p: _first(p).update(perplexity=float("inf")),
            "perplexity: Input should be a finite",
        ),
        (lambda p: _first(p).update(loss=float("nan")), "loss: Input should be a finite number"),
        (lambda p: _first(p).update(perplexity=0.5), "perplexity >= 1"),
        (lambda p: _first(p).update(perplexity=_first(p)["perplexity"] * 2), "is not exp(loss)"),
        (lambda p: _first(p).update(accuracy=2.0), "accuracy is not a metric of task lm"),
        (lambda p: _first(p).update(tokens=-1), "tokens and peak_memory_bytes must be 0..2^53"),
        (lambda p: _first(p).update(tokens=2**70), "tokens and peak_memory_bytes must be 0..2^53"),
        (lambda p: _first(p).update(tokens="256"), "tokens: Input should be a valid integer"),
        (lambda p: _first(p).update(not_applicable="no table"), "not applicable, yet has a loss"),
        (
            lambda p: _first(p)["position_bins"].append(_first(p)["position_bins"][0]),
            "two position bins start at the same position",
        ),
        (
            lambda p: _first(p)["position_bins"][0].update(end=10**6),
            "position bin [0, 1000000) must lie within 0..16",
        ),
        (lambda p: p["runs"][0]["train"]["curve"][0].update(step=-5), "step: -5 is not within"),
        (
            lambda p: p["runs"][0]["train"]["curve"][-1].update(elapsed=1e20),
            "elapsed: must be 0..315360000 seconds",
        ),
        (lambda p: p["runs"][0]["train"].update(steps="6"), "steps: Input should be a valid int"),
        (lambda p: _summary(p, name="bogus"), "'bogus' is not one of the order probe's"),
        (lambda p: _summary(p, value=float("inf")), "order_sensitivity must be a finite number"),
        (lambda p: p.update(runs=["x"]), "runs.0: Input should be an object"),
        (lambda p: p["runs"][0]["provenance"].update(big="x" * (1 << 21)), "larger than 1 MiB"),
    ],
)
def test_a_number_no_run_could_have_measured_is_refused(
    settings: Settings, payload: dict, tmp_path: Path, change, message: str
) -> None:
    path = write(tmp_path, _edited(payload, change))
    with pytest.raises(ImportProblem) as refused:
        import_results(path, settings=settings, actor="tester")
    assert message in str(refused.value)
    assert queries.studies(settings.database).empty


@pytest.mark.slow
def test_long_fine_tuning_curves_do_not_count_against_the_provenance_bound(
    settings: Settings, tuned_file: Path, tmp_path: Path
) -> None:
    # A long fine-tuning reporting every step: a curve over the 1 MiB provenance bound.
    payload = _retuned(json.loads(tuned_file.read_text()), 100_000)
    curve = [[step, 2.0] for step in range(1, 100_001)]
    payload["runs"][0]["provenance"]["finetune"]["yarn:2+ft100000"]["curve"] = curve
    imported = import_results(write(tmp_path, payload), settings=settings, actor="tester")
    assert imported.runs == 2
    stored = queries.runs(settings.database, study_id=imported.study_id)["provenance"][0]
    assert stored["finetune"]["yarn:2+ft100000"]["curve"] == curve


def test_a_file_nested_too_deep_or_with_huge_numbers_is_refused(
    settings: Settings, tmp_path: Path
) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"spec": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}")
    with pytest.raises(ImportProblem, match=r"deep\.json: not JSON"):
        import_results(deep, settings=settings, actor="tester")
    huge = tmp_path / "huge.json"
    huge.write_text('{"spec": {}, "runs": [' + "9" * 5000 + "]}")
    with pytest.raises(ImportProblem, match=r"huge\.json: not JSON"):
        import_results(huge, settings=settings, actor="tester")


def test_summaries_are_computed_from_the_imported_points(
    settings: Settings, payload: dict, tmp_path: Path
) -> None:
    def tamper(p: dict) -> None:
        for summary in p["runs"][0]["summaries"]:
            if summary["name"] == "ratio_2x":
                summary["value"] = 99.0

    done = posbench(settings, "import", str(write(tmp_path, _edited(payload, tamper))))
    assert done.returncode == 0, done.stderr
    stored = queries.run_summaries(settings.database, [1])
    ratio = stored[(stored["summary"] == "ratio_2x") & (stored["variant"] == "none")]
    rope = payload["runs"][0]
    by_length = {
        e["length"]: e["perplexity"] for e in rope["evaluations"] if e["variant"] == "none"
    }
    assert ratio[ratio["label"] == "rope"]["value"].iloc[0] == pytest.approx(
        by_length[32] / by_length[16]
    )


def test_a_missing_or_unreadable_file_says_so(settings: Settings, tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    listed = posbench(settings, "import", str(tmp_path / "list.json"))
    assert listed.returncode == 2 and "not the results.json of posbench run" in listed.stderr
    missing = posbench(settings, "import", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "nope.json: cannot be read" in missing.stderr
    (tmp_path / "bad.json").write_text("{not json")
    bad = posbench(settings, "import", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "bad.json: not JSON" in bad.stderr


def test_a_study_fine_tuned_by_posbench_run_imports_with_its_curves(
    settings: Settings, tuned_file: Path
) -> None:
    done = posbench(settings, "import", str(tuned_file))
    assert done.returncode == 0, done.stderr
    assert "imported study 1 (tuned): 2 runs, 6 evaluations" in done.stdout
    runs = queries.runs(settings.database, study_id=1).set_index("label")
    written = {r["label"]: r["provenance"] for r in json.loads(tuned_file.read_text())["runs"]}
    tuning = runs.loc["rope", "provenance"]["finetune"]["yarn:2+ft3"]
    assert tuning == written["rope"]["finetune"]["yarn:2+ft3"]
    assert [step for step, _ in tuning["curve"]] == [1, 2, 3]  # progress_every 1
    assert "finetune" not in runs.loc["alibi", "provenance"]  # not scalable: not tuned


def _long_curve(points: int) -> list:
    return [[step, 2.0] for step in range(1, points + 1)]


@pytest.mark.parametrize(
    ("tuned", "label", "curve", "message"),
    [
        # The reviewer's: a label no fine-tuning of the spec has, over the old bound.
        (False, "yarn:2+ft1", _long_curve(200_000), "not a fine-tuned variant of this run's"),
        (True, "yarn:2+ft200000", _long_curve(200_000), "(allowed: yarn:2+ft3)"),
        # The label of a 3-step fine-tuning with a long curve.
        (True, "yarn:2+ft3", _long_curve(200_000), ".curve: must be a list of at most 3 points"),
        (True, "yarn:2+ft3", [[1, "x" * 20_000_000]], "each point must be a pair [step, loss]"),
    ],
    ids=["unknown-label", "label-of-no-variant", "too-many-points", "not-numbers"],
)
def test_a_huge_fine_tuning_curve_is_refused_and_nothing_written(
    settings: Settings,
    payload: dict,
    tuned_file: Path,
    tmp_path: Path,
    tuned: bool,
    label: str,
    curve: list,
    message: str,
) -> None:
    edited = json.loads(tuned_file.read_text()) if tuned else _edited(payload, lambda p: None)
    edited["runs"][0]["provenance"]["finetune"] = {label: {"steps": 3, "curve": curve}}
    done = posbench(settings, "import", str(write(tmp_path, edited)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"runs[0].provenance.finetune.'{label}'" in done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert queries.studies(settings.database).empty
    assert queries.events(settings.database).empty


@pytest.mark.parametrize(
    ("curve", "message"),
    [
        ([[1, 2.0], [4, 2.0]], "the steps increasing within 1..3"),  # past its 3 steps
        ([[0, 2.0]], "the steps increasing within 1..3"),
        ([[2, 2.0], [1, 2.0]], "the steps increasing within 1..3"),
        ([[1, -1.0]], "the loss 0..2^53"),
        ([[1, float("nan")]], "the loss 0..2^53"),
        ([[1, True]], "a pair [step, loss] of numbers"),
        ({"1": 2.0}, "must be a list of at most 3 points"),
    ],
)
def test_a_fine_tuning_curve_no_run_could_have_recorded_is_refused(
    settings: Settings, tuned_file: Path, tmp_path: Path, curve, message: str
) -> None:
    edited = json.loads(tuned_file.read_text())
    edited["runs"][0]["provenance"]["finetune"]["yarn:2+ft3"]["curve"] = curve
    with pytest.raises(ImportProblem) as refused:
        import_results(write(tmp_path, edited), settings=settings, actor="tester")
    assert "runs[0].provenance.finetune.'yarn:2+ft3'.curve: " in str(refused.value)
    assert message in str(refused.value)
    assert queries.studies(settings.database).empty


# -- audit F8: per-group accuracies are bounded -------------------------------------------

PASSKEY = {
    "name": "groups",
    "model": "tiny",
    "task": "passkey",
    "train": {"length": 128, "steps": 2, "batch_size": 2},
    "encodings": ["rope"],
    "eval": {"lengths": [128], "examples": 8, "variants": ["none"]},
}


@pytest.fixture(scope="module")
def grouped() -> dict:
    spec, settings = parse_spec(PASSKEY), get_settings()
    task = prepared_task(spec, settings.corpus_cache)
    return run_study(spec, task=task, device=resolve_device(default=settings.device)).to_dict()


def test_groups_are_imported_within_their_bounds(
    settings: Settings, grouped: dict, payload: dict, tmp_path: Path
) -> None:
    groups = grouped["runs"][0]["evaluations"][0]["groups"]
    assert 1 < len(groups) <= PASSKEY["eval"]["examples"]  # the depths a passkey is hidden at

    def with_groups(base: dict, value: dict) -> dict:
        return _edited(base, lambda p: p["runs"][0]["evaluations"][0].update(groups=value))

    refused = {
        "lm": (with_groups(payload, {"depth=0.5": 0.5}), "task lm scores no groups"),
        "count": (
            with_groups(grouped, {f"g{i}": 0.5 for i in range(9)}),
            "9 groups; an evaluation has at most 8",
        ),
        "label": (with_groups(grouped, {"x" * 100_000: 0.5}), "is not a label"),
    }
    for name, (edited, message) in refused.items():
        done = posbench(settings, "import", str(write(tmp_path, edited, f"{name}.json")))
        assert done.returncode == 2 and message in done.stderr, (name, done.stderr)
    assert queries.studies(settings.database).empty
    done = posbench(settings, "import", str(write(tmp_path, grouped)))
    assert done.returncode == 0, done.stderr
