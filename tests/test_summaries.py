"""Per-run summaries end to end: computed at the end of a run, stored idempotently,
aggregated across seeds by `posbench results`, and a schema that matches the models."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from conftest import isolated_env, posbench_cli
from dashboard_seed import SEEDED_SPEC, seed_study
from sqlalchemy import func, select, update

from core.analysis import ANY_PROTOCOL, Summary, summarize_points
from core.settings import Settings
from core.status import RunStatus
from db import queries
from db.engine import engine_for, transaction
from db.migrate import current, downgrade, head, upgrade
from db.models import Base, Run, RunSummary
from jobs import lifecycle
from jobs.lifecycle import ClaimedRun
from worker.probes import OrderProbe
from worker.runtime import store


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    config = Settings(home=tmp_path)
    upgrade(config.database)
    return config


def test_the_migrations_build_exactly_the_models_schema(settings: Settings) -> None:
    assert current(settings.database) == head()
    with engine_for(settings.database).connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert differences == []


def test_order_probe_summaries_are_stored_protocol_free_and_migrate_both_ways(
    settings: Settings,
) -> None:
    seed_study(settings)
    url = settings.database

    def protocols() -> dict[bool, set[str]]:
        with transaction(url) as session:
            rows = session.execute(select(RunSummary.name, RunSummary.protocol)).all()
        found: dict[bool, set[str]] = {True: set(), False: set()}
        for name, protocol in rows:
            found[name.startswith("order_")].add(protocol)
        return found

    assert protocols() == {True: {ANY_PROTOCOL}, False: {"nonoverlapping"}}
    downgrade(url, "0002")  # where they lived under the first protocol's name
    assert protocols() == {True: {"nonoverlapping"}, False: {"nonoverlapping"}}
    upgrade(url)
    assert protocols() == {True: {ANY_PROTOCOL}, False: {"nonoverlapping"}}
    # Read for either protocol, the probe's summaries come along.
    for protocol in ("nonoverlapping", "sliding"):
        names = set(queries.run_summaries(url, None, protocol)["summary"])
        assert "order_sensitivity" in names


def test_summarize_turns_each_curve_into_its_summaries() -> None:
    points = [
        ("none", "nonoverlapping", 128, 5.0),
        ("none", "nonoverlapping", 256, 5.2),
        ("none", "nonoverlapping", 512, 8.0),
        ("yarn", "nonoverlapping", 128, 5.0),
        ("yarn", "nonoverlapping", 256, 10.0),
    ]
    order = OrderProbe(128, ordered_loss=1.5, shuffled_loss=1.75, tokens=100)
    found = {
        (s.variant, s.name): s.value
        for s in summarize_points(
            points, train_length=128, metric="perplexity", extra=order.as_summaries()
        )
    }
    assert found["none", "ratio_2x"] == pytest.approx(1.04)
    assert found["none", "ratio_4x"] == pytest.approx(1.6)
    assert found["none", "ratio_8x"] is None  # 1024 was not evaluated
    assert found["none", "effective_length"] == 256  # 5.2 <= 5.5 < 8.0
    assert found["yarn", "effective_length"] == 128
    assert found["yarn", "ratio_2x"] == pytest.approx(2.0)
    assert found["none", "order_sensitivity"] == pytest.approx(0.25)
    assert ("yarn", "order_sensitivity") not in found  # the probe runs on the trained model
    # The variant at 1x over the trained model at 1x; none for the trained model itself.
    assert found["yarn", "short_context_ratio"] == pytest.approx(1.0)
    assert ("none", "short_context_ratio") not in found
    costly = summarize_points(
        [*points[:3], ("yarn", "nonoverlapping", 128, 6.0), ("yarn", "sliding", 128, 6.0)],
        train_length=128,
        metric="perplexity",
    )
    ratios = {(s.variant, s.protocol): s.value for s in costly if s.name == "short_context_ratio"}
    assert ratios == {("yarn", "nonoverlapping"): pytest.approx(1.2)}  # no sliding 'none'


def stored(settings: Settings) -> int:
    with transaction(settings.database) as session:
        return session.scalar(select(func.count()).select_from(RunSummary))


def test_summaries_are_stored_once_per_key_even_when_a_finish_is_retried(
    settings: Settings,
) -> None:
    seed_study(settings)
    # 4 finished runs x (5 ratios + effective length and its censoring + 2 area summaries
    # + beyond training (None: not an answer task) + 3 order probe)
    assert stored(settings) == 4 * 13
    url = settings.database
    with transaction(url) as session:
        run = session.scalars(select(Run).where(Run.status == "done")).first()
        run_id = run.id
        session.execute(Run.__table__.update().where(Run.id == run_id).values(lease="again"))
    points = store.stored_points(url, run_id, "perplexity")
    assert sorted(n for _, _, n, _ in points) == [32, 64, 128]
    again = summarize_points(points, train_length=32, metric="perplexity")
    store.record_summaries(ClaimedRun(url, run_id, "again"), again)
    assert stored(settings) == 4 * 13
    with pytest.raises(lifecycle.LeaseLost):
        stolen = ClaimedRun(url, run_id, "someone else")
        store.record_summaries(stolen, [Summary("none", "x", "y", 1.0)])


def posbench(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    # A wide terminal: one summary per column.
    return posbench_cli(*args, env=isolated_env(settings.home, COLUMNS="240"))


def test_results_summaries_aggregate_the_seeds(settings: Settings) -> None:
    study = seed_study(settings)
    done = posbench(
        settings, "results", "--study", str(study), "--view", "summaries", "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    rows = {(r["line"], r["summary"]): r for r in json.loads(done.stdout)}
    rope, alibi = rows["rope", "ratio_4x"], rows["alibi", "ratio_4x"]
    assert rope["seeds"] == alibi["seeds"] == 2
    assert rope["mean"] > 5 > 1.1 > alibi["mean"] >= 1  # rope's loss grows 40x faster
    assert rope["low"] <= rope["mean"] <= rope["high"]
    assert rows["alibi", "effective_length"]["mean"] == 128
    assert rows["rope", "order_sensitivity"]["mean"] == pytest.approx(0.4)
    table = posbench(settings, "results", "--study", str(study), "--view", "summaries")
    assert table.returncode == 0 and "effective length" in table.stdout


def test_results_pairwise_attaches_a_probability_to_each_claim(settings: Settings) -> None:
    study = seed_study(settings)
    args = ("--study", str(study), "--view", "pairwise", "--factor", "4", "--format", "json")
    done = posbench(settings, "results", *args)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert (row["a"], row["b"], row["eval_length"]) == ("alibi", "rope", 128)
    assert row["p_a_wins"] == 1.0
    assert row["paired"] is True  # both encodings ran seeds 0 and 1 of this study
    assert row["claim"] == "alibi beats rope at 4x with probability 1.00 (2 paired seeds)"
    missing = posbench(
        settings, "results", "--study", str(study), "--view", "pairwise", "--factor", "3"
    )
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: --factor 3: no evaluation at 3 x 32"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--view", "table"],
            "--view must be one of curves, summaries, pairwise, groups, train, got 'table'",
        ),
        (["--factor", "2"], "--factor applies to --view pairwise only"),
    ],
)
def test_results_options_are_checked(settings: Settings, args: list[str], message: str) -> None:
    study = seed_study(settings)
    done = posbench(settings, "results", "--study", str(study), *args)
    assert done.returncode == 2 and done.stderr.strip() == f"error: {message}"


def test_results_groups_gives_accuracy_by_word_order_variant(settings: Settings) -> None:
    from core.analysis import summarize_points
    from core.results_schema import Evaluation
    from core.spec import parse_spec
    from jobs.service import submit

    spec = parse_spec(
        {
            "name": "turkish",
            "model": "tiny",
            "task": {"name": "sov_tr"},
            "train": {"length": 96, "steps": 4, "batch_size": 2},
            "encodings": ["nope", "rope"],
            "eval": {"lengths": [96, 192]},
        }
    )
    submitted = submit(spec, settings=settings, send=lambda run_id: None, actor="tester")
    url = settings.database
    for index, run_id in enumerate(submitted.queued):  # nope, then rope
        claimed = lifecycle.claim(url, run_id, "test")
        for length in (96, 192):
            bare = 0.9 if index == 1 else 0.2  # rope reads position, nope barely
            groups = {
                "variant=marked depth=0": 0.8,
                "variant=marked depth=1": 0.6,
                "variant=bare depth=0": bare,
                "variant=bare depth=1": bare,
            }
            row = Evaluation("none", "nonoverlapping", length, accuracy=0.6, groups=groups)
            store.record_evaluation(claimed, row)
        # As a worker does at the end of a run: summaries from every stored point.
        points = store.stored_points(url, run_id, spec.task.metric)
        summaries = summarize_points(points, train_length=96, metric=spec.task.metric)
        store.record_summaries(claimed, summaries)
        lifecycle.finish(claimed, RunStatus.DONE)
    args = ("--study", str(submitted.study_id), "--view", "groups", "--format", "json")
    done = posbench(settings, "results", *args)
    assert done.returncode == 0, done.stderr
    found = {
        (r["line"], r["key"], r["value"], r["eval_length"]): r for r in json.loads(done.stdout)
    }
    assert found["rope", "variant", "bare", 192]["accuracy"] == pytest.approx(0.9)
    assert found["nope", "variant", "bare", 192]["accuracy"] == pytest.approx(0.2)
    assert found["nope", "variant", "marked", 96]["accuracy"] == pytest.approx(0.7)
    assert found["nope", "depth", "1", 96]["accuracy"] == pytest.approx(0.4)
    assert len(found) == 2 * 2 * (2 + 2)  # lines x lengths x (2 variants + 2 depths)
    # An answer task's summaries hold its mean accuracy past the training length (192).
    args = ("--study", str(submitted.study_id), "--view", "summaries")
    summaries = json.loads(posbench(settings, "results", *args, "--format", "json").stdout)
    beyond = {r["line"]: r["mean"] for r in summaries if r["summary"] == "beyond_training"}
    assert beyond == {"nope": pytest.approx(0.6), "rope": pytest.approx(0.6)}
    assert "beyond training" in posbench(settings, "results", *args).stdout


def test_a_reused_run_brings_its_summaries(settings: Settings) -> None:
    from jobs.service import submit

    seed_study(settings)
    again = submit(SEEDED_SPEC, settings=settings, send=lambda run_id: None, actor="tester")
    assert len(again.reused) == 4  # the finished runs
    assert stored(settings) == 2 * 4 * 13


def test_db_upgrade_summarises_runs_finished_before_summaries_existed(settings: Settings) -> None:
    seed_study(settings)
    with transaction(settings.database) as session:
        session.execute(RunSummary.__table__.delete())
    done = posbench(settings, "db", "upgrade")
    assert done.returncode == 0, done.stderr
    assert "summarised 4 runs finished before summaries were stored" in done.stdout
    assert stored(settings) == 4 * 10  # the curve summaries; the order probe needs the model


def test_db_upgrade_fills_a_summary_added_after_a_run_was_summarised(settings: Settings) -> None:
    seed_study(settings)
    with transaction(settings.database) as session:
        session.execute(
            RunSummary.__table__.delete().where(RunSummary.name == "effective_length_censored")
        )
        session.execute(update(RunSummary).where(RunSummary.name == "ratio_2x").values(value=123.0))
    before = stored(settings)
    done = posbench(settings, "db", "upgrade")
    assert done.returncode == 0, done.stderr
    assert stored(settings) == before + 4  # one per finished run, nothing twice
    with transaction(settings.database) as session:
        kept = session.scalars(select(RunSummary.value).where(RunSummary.name == "ratio_2x"))
        assert set(kept) == {123.0}  # stored values stay
        censored = session.scalars(
            select(RunSummary.value).where(RunSummary.name == "effective_length_censored")
        )
        assert sorted(censored) == [0.0, 0.0, 1.0, 1.0]  # rope fails at 64; alibi holds


def test_the_encoding_summaries_view_aggregates_the_seeds_for_sql(settings: Settings) -> None:
    from sqlalchemy import text

    study = seed_study(settings)
    with engine_for(settings.database).connect() as connection:
        rows = connection.execute(
            text(
                "SELECT label, mean, min, max, seeds FROM encoding_summaries "
                "WHERE study_id = :study AND name = 'effective_length' ORDER BY label"
            ),
            {"study": study},
        ).all()
    assert [tuple(row) for row in rows] == [("alibi", 128, 128, 128, 2), ("rope", 32, 32, 32, 2)]


def test_a_curve_cut_short_by_its_encoding_has_no_log_perplexity_average() -> None:
    # A learned table evaluated past its end: its average over the lengths it can read
    # would look better than curves that pay for the longer ones.
    from core.analysis import summarize_run

    whole = summarize_run({32: 10.0, 64: 12.0, 128: 20.0}, 32, "perplexity")
    cut = summarize_run({32: 10.0, 64: None, 128: None}, 32, "perplexity")
    assert whole["mean_log_ppl"] is not None and whole["ratio_2x"] == 1.2
    assert cut["mean_log_ppl"] is None and cut["log_ppl_area"] is None
    assert cut["ratio_2x"] is None and cut["effective_length"] == 32


def test_delete_asks_first_then_removes_the_study(settings: Settings) -> None:
    study = seed_study(settings)
    env = isolated_env(settings.home)
    busy = posbench_cli("delete", str(study), "--yes", env=env)
    assert busy.returncode == 1
    assert busy.stderr.strip() == (
        f"error: study {study} has 1 run queued or running: cancel first "
        f"(posbench cancel {study}) and wait until they stop"
    )
    cancelled = posbench_cli("cancel", str(study), env=env)
    assert cancelled.returncode == 0 and "1 stopping" in cancelled.stdout
    with transaction(settings.database) as session:  # its worker sees the cancel and stops
        session.execute(
            update(Run).where(Run.status == "running").values(status="cancelled", lease=None)
        )
    kept = posbench_cli("delete", str(study), env=env, input="n\n")
    assert kept.returncode == 1 and "nothing deleted" in kept.stderr
    assert not queries.studies(settings.database, [study]).empty
    done = posbench_cli("delete", str(study), env=env, input="y\n")
    assert done.returncode == 0, done.stderr
    assert f"deleted study {study} (seeded): 6 runs, 12 evaluations" in done.stdout
    assert queries.studies(settings.database, [study]).empty
    assert queries.curves(settings.database, study_ids=[study]).empty


def test_results_train_view_lists_every_point_and_one_row_per_run(settings: Settings) -> None:
    study = seed_study(settings)
    done = posbench(
        settings, "results", "--study", str(study), "--view", "train", "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    rope = [(r["seed"], r["step"], r["loss"]) for r in rows if r["line"] == "rope"]
    assert rope == [(0, 20, 3.0), (0, 40, 2.5), (1, 20, 3.2), (1, 40, 2.5)]
    validated = [(r["seed"], r["step"], r["val_loss"]) for r in rows if r["line"] == "rope"]
    assert validated == [(0, 20, None), (0, 40, 2.6), (1, 20, None), (1, 40, 2.7)]
    assert {r["line"] for r in rows} == {"alibi", "rope", "t5"}  # t5 seed 0 is halfway
    table = posbench(settings, "results", "--study", str(study), "--view", "train")
    assert table.returncode == 0 and "final loss" in table.stdout and "lowest loss" in table.stdout
    assert "final val loss" in table.stdout


def test_db_upgrade_summarises_a_run_under_its_study_s_own_effective_length_threshold(
    settings: Settings,
) -> None:
    """A study with ``eval.effective_length`` set is re-summarised under that threshold
    (its bound row included), not the default one."""
    from db.models import Study
    from jobs.service import backfill_summaries

    seed_study(settings)
    chosen = {"threshold": None, "relative": 0.9}  # as a stored spec spells it
    with transaction(settings.database) as session:
        study = session.scalars(select(Study)).one()
        study.spec = {**study.spec, "eval": {**study.spec["eval"], "effective_length": chosen}}
        session.execute(RunSummary.__table__.delete())
    assert backfill_summaries(settings.database) == 4
    with transaction(settings.database) as session:
        rows = session.execute(
            select(RunSummary.run_id, RunSummary.name, RunSummary.value).where(
                RunSummary.name.in_(["effective_length", "effective_length_bound"])
            )
        ).all()
    expected = {
        (run_id, summary.name, summary.value)
        for run_id in {row.run_id for row in rows}
        for summary in summarize_points(
            store.stored_points(settings.database, run_id, "perplexity"),
            train_length=32,
            metric="perplexity",
            effective=chosen,
        )
        if summary.name in ("effective_length", "effective_length_bound")
    }
    assert {(r.run_id, r.name, r.value) for r in rows} == expected
    assert sum(r.name == "effective_length_bound" for r in rows) == 4
    # Held to 1x / 0.9 rather than 1.1 x 1x: rope (growing 0.02 nats a byte) fails at 64.
    assert sorted(r.value for r in rows if r.name == "effective_length") == [32, 32, 128, 128]
