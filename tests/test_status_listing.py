"""`posbench status` lists the newest studies (20 by default), says how many more there
are, and filters by a run status and by name; the bounds apply before the runs are
counted (db.queries.studies)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import dashboard_settings, isolated_env, posbench_cli

from dashboard.common import PICKER_STUDIES
from db import queries
from db.engine import engine_for
from db.migrate import upgrade
from db.models import Run, Study


def fill(url: str, studies: int) -> None:
    """``studies`` studies named 'alpha-N' / 'beta-N', two runs each (one done; the
    other failed for every fifth study, else queued), written in one transaction."""
    engine = engine_for(url)
    with engine.begin() as connection:
        for index in range(1, studies + 1):
            name = f"{'alpha' if index % 2 else 'beta'}-{index}"
            connection.execute(
                sa.insert(Study).values(
                    id=index, name=name, task="lm", metric="perplexity", train_length=16, spec={}
                )
            )
            for seed, status in enumerate(["done", "failed" if index % 5 == 0 else "queued"]):
                connection.execute(
                    sa.insert(Run).values(
                        study_id=index,
                        label="rope",
                        encoding="rope",
                        params={},
                        seed=seed,
                        config_hash=f"{index}-{seed}",
                        status=status,
                        total_steps=10,
                    )
                )


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("home")
    url = f"sqlite:///{folder}/posbench.db"
    upgrade(url)
    fill(url, 45)
    return folder


def listed(home: Path, *args: str) -> list[int]:
    done = posbench_cli("status", *args, "--json", env=isolated_env(home))
    assert done.returncode == 0, done.stderr
    return [study["id"] for study in json.loads(done.stdout)]


def test_the_newest_twenty_by_default_and_how_many_more(home: Path) -> None:
    assert listed(home) == list(range(45, 25, -1))
    shown = posbench_cli("status", env=isolated_env(home, COLUMNS="100"))
    assert "the newest 20 of 45 studies; 25 more" in shown.stdout
    assert "2 runs: 1 queued, 1 done" in shown.stdout


def test_limit_all_status_and_name(home: Path) -> None:
    assert listed(home, "--limit", "3") == [45, 44, 43]
    assert len(listed(home, "--all")) == 45
    assert listed(home, "--status", "failed") == [45, 40, 35, 30, 25, 20, 15, 10, 5]
    assert listed(home, "--name", "BETA", "--limit", "2") == [44, 42]
    assert listed(home, "--name", "beta-4", "--status", "failed") == [40]
    assert listed(home, "--name", "%") == []  # a wildcard is a character, not a pattern
    full = posbench_cli("status", "--status", "failed", env=isolated_env(home)).stdout
    assert "more" not in full  # all 9 are shown


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--status", "lost"], "--status must be one of queued, running, done"),
        (["--all", "--limit", "3"], "give --limit N or --all, not both"),
        (["3", "--name", "x"], "filter the list of studies: give no study id"),
    ],
)
def test_bad_listing_options_exit_2(home: Path, args: list[str], message: str) -> None:
    done = posbench_cli("status", *args, env=isolated_env(home))
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_bounds_are_applied_before_the_runs_are_counted(home: Path) -> None:
    url = f"sqlite:///{home}/posbench.db"
    frame = queries.studies(url, limit=2, status="failed")
    assert frame["id"].tolist() == [45, 40]
    assert frame["runs"].tolist() == [2, 2] and frame["failed"].tolist() == [1, 1]
    assert queries.count_studies(url, name="alpha") == 23


@pytest.fixture
def crowded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A dashboard whose database holds 250 studies."""
    for settings in dashboard_settings(tmp_path, monkeypatch):
        fill(settings.database, 250)
        yield settings


@pytest.mark.parametrize(("name", "key"), [("queue", "study"), ("compare", "studies")])
def test_the_dashboard_pickers_offer_the_newest_and_find_the_rest(
    crowded, name: str, key: str
) -> None:
    from test_dashboard import page

    app = page(name)
    app.query_params[key] = "7"  # a study the URL names is offered, however old
    app.run()
    assert not app.exception, app.exception
    picker = app.selectbox(key=key) if name == "queue" else app.multiselect(key=key)
    assert len(picker.options) == PICKER_STUDIES + 1
    assert picker.options[0].startswith("7: ") and picker.options[1].startswith("250: ")
    assert any("The newest 200 of 250 studies in all" in c.value for c in app.caption)
    app.text_input(key=f"{key}:find").set_value("beta-24").run()
    picker = app.selectbox(key=key) if name == "queue" else app.multiselect(key=key)
    # beta-24 and beta-240..248 (even numbers only), newest first, and the one named.
    assert [o.split(":")[0] for o in picker.options] == [
        "7", "248", "246", "244", "242", "240", "24"
    ]  # fmt: skip


def test_the_status_benchmark_builds_its_database_and_reports(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "status.json"
    command = ["benchmarks.status_scale", "--studies", "50", "--rounds", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "50 studies, 150 runs, 450 evaluations" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) >= {"posbench status (newest 20)", "picker: newest 200 + count"}
    assert all(r["seconds"] > 0 for r in results.values())
