"""The audit trail and recovery (docs/security.md, "Audit and recovery"): who did what is
recorded with each change, a delete hides a study and can be undone within the retention
period, a purge removes it for good, and one submitter cannot take every active run. On
a real SQLite database; the CLI in real subprocesses, the Queue page through AppTest."""

from __future__ import annotations

import datetime as dt
import json
import os
import pwd
import re
import threading
from pathlib import Path

import pytest
import yaml
from conftest import FOUR_RUNS, ROOT, dashboard_settings, isolated_env, oidc_login, posbench_cli
from dashboard_seed import SEEDED_SPEC, seed_study
from sqlalchemy import select, text, update
from streamlit.testing.v1 import AppTest

from core.settings import Settings, get_settings
from core.spec import parse_spec
from core.status import RunStatus
from db import queries
from db.engine import engine_for, transaction
from db.migrate import upgrade
from db.models import Event, Run, Study
from jobs import reconciler
from jobs.audit import RETENTION_ACTOR, actor_name
from jobs.retention import Busy, NotDeleted, delete_study, purge, restore_study
from jobs.service import NotFound, Refused, cancel, retry, submit
from worker.runtime.cache import cached_models

SPEC = FOUR_RUNS
OSC8 = "\x1b]8;"  # a terminal hyperlink: what markup in a name must never become
SGR = re.compile(r"\x1b\[[0-9;]*m")
ME = f"{pwd.getpwuid(os.getuid()).pw_name} (cli)"  # who runs these tests, as the CLI names them


def no_broker(run_id: int) -> None:
    """The broker, absent: the runs stay queued (nothing here trains)."""


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    config = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/audit.db")
    upgrade(config.database)
    return config


def trail(config: Settings) -> list[tuple[str, str, int | None, int | None]]:
    """(actor, action, study, run) of every event, oldest first."""
    with transaction(config.database) as session:
        rows = session.execute(
            select(Event.actor, Event.action, Event.study_id, Event.run_id).order_by(Event.id)
        ).all()
    return [tuple(row) for row in rows]


def finish_every_run(config: Settings) -> None:
    """Every active run ends (done): the study is no longer busy and its results serve
    the result cache."""
    with transaction(config.database) as session:
        session.execute(
            update(Run)
            .where(Run.status.in_((RunStatus.QUEUED, RunStatus.RUNNING)))
            .values(status=RunStatus.DONE, finished_at=dt.datetime.now(dt.UTC), lease=None)
        )


def deleted_at(config: Settings, study_id: int) -> dt.datetime:
    with transaction(config.database) as session:
        moment = session.get(Study, study_id).deleted_at
    return moment.replace(tzinfo=dt.UTC) if moment.tzinfo is None else moment


# --- the service: every action, its actor, in its transaction ----------------------------


def test_every_action_records_who_did_it(settings: Settings) -> None:
    submitted = submit(
        parse_spec(SPEC), actor="alice@lab.example", settings=settings, send=no_broker
    )
    study, (first, *_) = submitted.study_id, submitted.queued
    cancel(run_id=first, actor="bob@lab.example", settings=settings)
    retry(study_id=study, actor="carol (cli)", settings=settings, send=no_broker)
    with pytest.raises(Busy):  # refused: no change, so no event either
        delete_study(study, actor="dave (cli)", settings=settings)
    cancel(study_id=study, actor="dave (cli)", settings=settings)
    deleted = delete_study(study, actor="dave (cli)", settings=settings)
    restore_study(study, actor="erin (cli)", settings=settings)
    delete_study(study, actor="dave (cli)", settings=settings)
    purged = purge(settings, now=deleted.purge_at + dt.timedelta(days=1))
    assert purged.studies == [study]
    assert trail(settings) == [
        ("alice@lab.example", "submit", study, None),
        ("bob@lab.example", "cancel", study, first),  # the run, and its study
        ("carol (cli)", "retry", study, None),
        ("dave (cli)", "cancel", study, None),
        ("dave (cli)", "delete", study, None),
        ("erin (cli)", "restore", study, None),
        ("dave (cli)", "delete", study, None),
        (RETENTION_ACTOR, "purge", study, None),  # outlives the study it names
    ]
    details = list(queries.events(settings.database, study)["detail"])[::-1]  # oldest first
    until = deleted.purge_at.strftime("%Y-%m-%d %H:%M UTC")
    assert details[:5] == [
        "study: 4 runs queued, 0 reused",
        "1 cancelled, 0 stopping",
        "1 run queued again",
        "4 cancelled, 0 stopping",
        f"study: 4 runs, 0 evaluations; restorable until {until}",
    ]
    assert details[5].startswith("study: deleted by dave (cli), ")
    assert details[7].startswith("study: 4 runs, 0 evaluations, deleted by dave (cli), ")


def test_the_submitter_is_stored_and_an_actor_is_kept_to_one_bounded_line(
    settings: Settings,
) -> None:
    long = "x" * 300 + "\n(cli)"
    study = submit(parse_spec(SPEC), actor=long, settings=settings, send=no_broker).study_id
    with transaction(settings.database) as session:
        stored = session.get(Study, study).submitted_by
    assert stored == actor_name(long) and len(stored) == 200 and "\n" not in stored
    assert trail(settings) == [(stored, "submit", study, None)]
    assert actor_name("  ") == "(unknown)"


def test_an_action_on_a_deleted_study_is_refused_with_who_deleted_it(settings: Settings) -> None:
    submitted = submit(parse_spec(SPEC), actor="alice", settings=settings, send=no_broker)
    study = submitted.study_id
    cancel(study_id=study, actor="alice", settings=settings)
    delete_study(study, actor="bob", settings=settings)
    before = trail(settings)
    for action in (
        lambda: cancel(study_id=study, actor="carol", settings=settings),
        lambda: retry(run_id=submitted.queued[0], actor="carol", settings=settings),
        lambda: delete_study(study, actor="carol", settings=settings),
    ):
        with pytest.raises(NotFound, match=rf"study {study} is deleted \(by bob, .* UTC\): "):
            action()
    assert trail(settings) == before  # refused: nothing changed, nothing recorded
    live = submit(parse_spec(SPEC), actor="alice", settings=settings, send=no_broker).study_id
    with pytest.raises(NotDeleted, match=f"study {live} is not deleted: only a deleted study"):
        purge(settings, study_id=live)


# --- a deleted study is hidden, serves no cache, and comes back -------------------------


def test_a_deleted_study_is_hidden_everywhere_and_its_results_are_not_reused(
    settings: Settings,
) -> None:
    url = settings.database
    study = seed_study(settings)  # 4 runs done (curves, summaries), 1 running, 1 failed
    finish_every_run(settings)
    runs = queries.runs(url, study_id=study)
    done = runs[runs["status"] == "done"]
    train_hash = session_train_hash(settings, int(done["id"].iloc[0]))
    assert not queries.curves(url, study_ids=[study]).empty
    assert len(cached_models(url, train_hash, -1)) == 1

    deleted = delete_study(study, actor="alice", settings=settings)
    assert (deleted.name, deleted.runs, deleted.evaluations) == ("seeded", 6, 12)
    assert queries.studies(url).empty and queries.studies(url, [study]).empty
    assert queries.runs(url, study_id=study).empty and queries.runs(url).empty
    assert queries.curves(url, study_ids=[study]).empty and queries.curves(url).empty
    assert queries.run_summaries(url, [study]).empty
    assert queries.train_points(url, runs["id"].tolist()).empty
    assert queries.study_spec(url, study) is None
    with engine_for(url).connect() as connection:
        assert not connection.execute(text("SELECT * FROM encoding_summaries")).all()
    listed = queries.deleted_studies(url)
    assert list(listed["id"]) == [study] and list(listed["deleted_by"]) == ["alice"]
    assert list(listed["submitted_by"]) == ["tester"] and list(listed["runs"]) == [6]
    # Its results and its trained models serve no one: everything trains again.
    assert cached_models(url, train_hash, -1) == []
    again = submit(SEEDED_SPEC, actor="bob", settings=settings, send=no_broker)
    assert again.reused == [] and len(again.queued) == 6
    cancel(study_id=again.study_id, actor="bob", settings=settings)

    restored = restore_study(study, actor="carol", settings=settings)
    assert (restored.name, restored.runs) == ("seeded", 6)
    assert list(queries.studies(url)["id"]) == [again.study_id, study]
    assert len(queries.curves(url, study_ids=[study])) == 12
    # Restored, its finished runs serve the cache again (the failed one trains).
    third = submit(SEEDED_SPEC, actor="bob", settings=settings, send=no_broker)
    assert len(third.reused) == 5 and len(third.queued) == 1
    with pytest.raises(NotDeleted, match="not deleted: there is nothing to restore"):
        restore_study(study, actor="carol", settings=settings)


def session_train_hash(config: Settings, run_id: int) -> str:
    with transaction(config.database) as session:
        return session.get(Run, run_id).train_hash


# --- the retention period, then the purge ----------------------------------------------


def test_the_purge_removes_a_study_past_its_retention_with_its_checkpoints(
    settings: Settings,
) -> None:
    submitted = submit(parse_spec(SPEC), actor="alice", settings=settings, send=no_broker)
    study, runs = submitted.study_id, submitted.queued
    other = submit(
        parse_spec({**SPEC, "name": "kept"}), actor="bob", settings=settings, send=no_broker
    )
    finish_every_run(settings)
    folder = settings.artifacts_dir / "runs"
    folder.mkdir(parents=True)
    for run_id in [*runs, other.queued[0]]:
        (folder / f"{run_id}.pt").write_bytes(b"checkpoint")
    delete_study(study, actor="alice", settings=settings)
    at = deleted_at(settings, study)

    # Within the retention (7 days by default): nothing goes, it can come back.
    assert purge(settings, now=at + dt.timedelta(days=6, hours=23)).studies == []
    assert len(list(folder.iterdir())) == 5
    # Past it, but before a purge ran: no restore (the retention is a promise both ways).
    late = settings.model_copy(update={"delete_retention_days": 0.0})
    with pytest.raises(NotFound, match="longer ago than POSBENCH_DELETE_RETENTION_DAYS"):
        restore_study(study, actor="alice", settings=late)

    purged = purge(settings, now=at + dt.timedelta(days=7, seconds=1))
    assert (purged.studies, purged.runs, purged.checkpoints) == ([study], 4, 4)
    assert sorted(p.name for p in folder.iterdir()) == [f"{other.queued[0]}.pt"]
    with transaction(settings.database) as session:
        assert session.get(Study, study) is None
        assert session.scalars(select(Run.study_id).distinct()).all() == [other.study_id]
    assert trail(settings)[-1] == (RETENTION_ACTOR, "purge", study, None)
    with pytest.raises(
        NotFound, match=rf"study {study} was purged \(.*, by posbench \(retention\)\)"
    ):
        restore_study(study, actor="alice", settings=settings)
    assert purge(settings, now=at + dt.timedelta(days=30)).studies == []  # nothing twice


def test_the_reconciler_purges_on_each_pass(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    study = submit(parse_spec(SPEC), actor="alice", settings=settings, send=no_broker).study_id
    finish_every_run(settings)
    delete_study(study, actor="alice", settings=settings)
    for name, value in {
        "POSBENCH_HOME": str(settings.home),
        "POSBENCH_DATABASE_URL": settings.database,
        "POSBENCH_RECONCILE_SECONDS": "0.01",
        "POSBENCH_DELETE_RETENTION_DAYS": "0",
    }.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    stop = threading.Event()
    passes = []

    def one_pass(**kwargs):  # the broker is not needed here: only the purge is watched
        passes.append(kwargs)
        stop.set()
        return {}

    monkeypatch.setattr(reconciler, "reconcile", one_pass)
    try:
        reconciler.loop(stop)
    finally:
        get_settings.cache_clear()
    assert len(passes) == 1
    assert trail(settings)[-1] == (RETENTION_ACTOR, "purge", study, None)
    assert queries.deleted_studies(settings.database).empty


# --- the per-submitter quota -----------------------------------------------------------


def test_one_submitter_cannot_take_every_active_run(tmp_path: Path) -> None:
    config = Settings(
        home=tmp_path,
        database_url=f"sqlite:///{tmp_path}/quota.db",
        max_active_runs_per_submitter=6,
    )
    upgrade(config.database)
    submit(parse_spec(SPEC), actor="alice", settings=config, send=no_broker)
    again = parse_spec({**SPEC, "name": "again", "seeds": [2, 3]})
    with pytest.raises(Refused) as refused:
        submit(again, actor="alice", settings=config, send=no_broker)
    assert str(refused.value) == (
        "quota POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER exceeded: alice has 4 runs queued or "
        "running and this study adds 4, 8 in all, over the limit of 6 by 2; wait for your "
        "runs to finish or cancel some"
    )
    # Another submitter is within theirs (and the service's), and so is alice once hers
    # have ended.
    assert len(submit(again, actor="bob", settings=config, send=no_broker).queued) == 4
    finish_every_run(config)
    third = parse_spec({**SPEC, "name": "third", "seeds": [4, 5]})
    assert len(submit(third, actor="alice", settings=config, send=no_broker).queued) == 4


# --- the CLI -----------------------------------------------------------------------------


def cli_env(home: Path, user: str, **extra: str) -> dict[str, str]:
    """posbench's environment with $LOGNAME and $USER saying ``user`` (which changes
    nobody's identity: the CLI names the OS account), in a wide terminal where Rich
    markup would colour and link."""
    return isolated_env(home, LOGNAME=user, USER=user, COLUMNS="400", FORCE_COLOR="1", **extra)


def test_the_cli_records_the_os_user_and_shows_the_events_as_text(tmp_path: Path) -> None:
    name = "[link=http://evil]x[/link] oops [/]"
    env = cli_env(tmp_path, "alice")
    assert posbench_cli("db", "upgrade", env=env).returncode == 0
    spec = yaml.safe_load((ROOT / "core" / "presets" / "smoke.yaml").read_text())
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({**spec, "name": name}))
    submitted = posbench_cli("submit", str(spec_file), "--json", env=env)
    assert submitted.returncode == 0, submitted.stderr
    study = json.loads(submitted.stdout)["study"]
    assert posbench_cli("cancel", str(study), env=cli_env(tmp_path, "bob")).returncode == 0

    shown = posbench_cli("status", "--events", env=env)
    assert shown.returncode == 0, shown.stderr
    assert OSC8 not in shown.stdout
    plain = SGR.sub("", shown.stdout)
    assert f"{name}: 3 runs queued, 0 reused" in plain
    assert ME in plain and "alice" not in plain and "bob" not in plain
    events = json.loads(posbench_cli("status", "--events", "--json", env=env).stdout)
    assert [(e["actor"], e["action"], e["study_id"], e["run_id"]) for e in events] == [
        (ME, "cancel", study, None),  # newest first
        (ME, "submit", study, None),
    ]
    limited = posbench_cli("status", "--events", str(study), "--limit", "1", "--json", env=env)
    assert [e["action"] for e in json.loads(limited.stdout)] == ["cancel"]
    wrong = posbench_cli("status", str(study), "--limit", "3", env=env)
    assert wrong.returncode == 2 and "--limit applies to the list of studies" in wrong.stderr


def test_delete_restore_and_purge_from_the_cli(tmp_path: Path) -> None:
    env = cli_env(tmp_path, "alice")
    home = Settings(home=tmp_path)
    upgrade(home.database)
    study = submit(parse_spec(SPEC), actor="alice (cli)", settings=home, send=no_broker).study_id
    finish_every_run(home)

    deleted = posbench_cli("delete", str(study), env=cli_env(tmp_path, "bob"), input="y\n")
    assert deleted.returncode == 0, deleted.stderr
    assert "It can be restored for 7 days" in deleted.stdout  # the question asked
    assert f"posbench restore {study} brings it back until" in deleted.stdout
    assert json.loads(posbench_cli("status", "--json", env=env).stdout) == []
    for args in (["status", str(study)], ["results", "--study", str(study)]):
        hidden = posbench_cli(*args, env=env)
        assert hidden.returncode == 2
        assert f"study {study} is deleted (by {ME}, " in hidden.stderr
    listed = json.loads(posbench_cli("status", "--deleted", "--json", env=env).stdout)
    assert [(s["id"], s["submitted_by"], s["deleted_by"]) for s in listed] == [
        (study, "alice (cli)", ME)
    ]
    deleted_at, purge_at = (
        dt.datetime.fromisoformat(listed[0][key].replace("Z", "+00:00"))
        for key in ("deleted_at", "purge_at")
    )
    assert deleted_at.tzinfo is not None and purge_at - deleted_at == dt.timedelta(days=7)

    restored = posbench_cli("restore", str(study), env=env)
    assert restored.returncode == 0 and f"restored study {study} (study): 4 runs" in restored.stdout
    assert [s["id"] for s in json.loads(posbench_cli("status", "--json", env=env).stdout)] == [
        study
    ]
    assert posbench_cli("delete", str(study), "--yes", env=env).returncode == 0
    nothing = posbench_cli("purge", env=env)  # within the retention: nothing goes
    assert nothing.returncode == 0 and "nothing to purge" in nothing.stdout
    kept = posbench_cli("purge", "--study", str(study), env=env, input="n\n")
    assert kept.returncode == 1 and "nothing purged" in kept.stderr
    gone = posbench_cli("purge", "--study", str(study), "--yes", env=env)
    assert gone.returncode == 0, gone.stderr
    assert f"purged 1 study ({study}): 4 runs, 0 evaluations" in gone.stdout
    late = posbench_cli("restore", str(study), env=env)
    assert late.returncode == 2
    assert f"study {study} was purged (" in late.stderr and f"by {ME})" in late.stderr
    actions = [
        e["action"]
        for e in json.loads(posbench_cli("status", "--events", "--json", env=env).stdout)
    ]
    assert actions == ["purge", "delete", "restore", "delete", "submit"]


def test_the_cli_actor_is_the_os_account_whatever_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fourth audit's G5: getpass read $LOGNAME first, and changing it passed the
    # per-submitter quota twice.
    from cli.common import cli_actor

    for name in ("alice", "bob"):
        for variable in ("LOGNAME", "USER", "LNAME", "USERNAME"):
            monkeypatch.setenv(variable, name)
        assert cli_actor() == ME

    def nameless(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", nameless)
    assert cli_actor() == f"uid {os.getuid()} (cli)"


# --- the Queue page ----------------------------------------------------------------------


@pytest.fixture
def dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)


def queue_page() -> AppTest:
    def script() -> None:
        from dashboard import queue_page

        queue_page.render()

    return AppTest.from_function(script, default_timeout=60)


def frame_with(app: AppTest, column: str):
    """The first table on the page with ``column`` (events: actor; deleted: deleted_by)."""
    return next(frame.value for frame in app.dataframe if column in frame.value.columns)


def test_the_queue_page_records_its_operator_and_shows_the_events(dashboard) -> None:
    study = seed_study(dashboard)
    finish_every_run(dashboard)
    app = queue_page()
    app.query_params["study"] = str(study)
    app.run()
    assert not app.exception, app.exception
    events = frame_with(app, "actor")
    assert list(events["actor"]) == ["tester"] and list(events["action"]) == ["submit"]

    app.checkbox(key="delete-sure").check().run()
    app.button(key="delete").click().run()
    assert not app.exception, app.exception
    assert trail(dashboard)[-1] == ("dashboard operator (no login)", "delete", study, None)
    # The page now shows no study, the deleted one to restore, and every event.
    assert "No study yet" in app.info[0].value
    assert list(frame_with(app, "actor")["action"]) == ["delete", "submit"]
    deleted = frame_with(app, "deleted_by")
    assert list(deleted["deleted_by"]) == ["dashboard operator (no login)"]

    app.button(key="restore").click().run()
    assert not app.exception, app.exception
    assert trail(dashboard)[-1] == ("dashboard operator (no login)", "restore", study, None)
    assert list(queries.studies(dashboard.database)["id"]) == [study]
    assert list(frame_with(app, "actor")["action"]) == ["restore", "delete", "submit"]


def gated_queue_page() -> AppTest:
    """The Queue page behind the dashboard's login, as app.py puts it there."""

    def script() -> None:
        from dashboard import auth, queue_page

        if auth.gate():
            queue_page.render()

    return AppTest.from_function(script, default_timeout=60)


def delete_on_the_page(app: AppTest, study: int) -> AppTest:
    app.query_params["study"] = str(study)
    app.run()
    assert not app.exception, app.exception
    app.checkbox(key="delete-sure").check().run()
    app.button(key="delete").click().run()
    assert not app.exception, app.exception
    return app


@pytest.fixture
def oidc_dashboard(dashboard, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The dashboard behind an OIDC login whose operators are @lab.example."""
    yield from oidc_login(tmp_path, monkeypatch, operators="@lab.example")


def test_an_oidc_operator_is_recorded_by_e_mail(oidc_dashboard, dashboard) -> None:
    study = seed_study(dashboard)
    finish_every_run(dashboard)
    app = gated_queue_page()
    app.user = {"is_logged_in": True, "email": "alice@lab.example", "email_verified": True}
    delete_on_the_page(app, study)
    assert trail(dashboard)[-1] == ("alice@lab.example", "delete", study, None)
    assert list(frame_with(app, "deleted_by")["deleted_by"]) == ["alice@lab.example"]
    assert list(frame_with(app, "actor")["actor"]) == ["alice@lab.example", "tester"]


def test_a_password_operator_is_recorded_by_the_role_and_the_address_only_logged(
    dashboard, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    import logging

    from dashboard import auth

    monkeypatch.setenv("POSBENCH_DASHBOARD_PASSWORD", "s3cret")
    get_settings.cache_clear()
    study = seed_study(get_settings())
    finish_every_run(dashboard)
    monkeypatch.setattr(auth, "client_address", lambda: "203.0.113.99")
    app = gated_queue_page().run()
    app.text_input[0].set_value("s3cret")
    with caplog.at_level(logging.INFO, logger="posbench.dashboard.auth"):
        app.button[0].click().run()
    assert "dashboard login from 203.0.113.99 as operator" in caplog.text
    delete_on_the_page(app, study)
    assert trail(dashboard)[-1] == ("dashboard operator", "delete", study, None)
    assert list(frame_with(app, "deleted_by")["deleted_by"]) == ["dashboard operator"]
