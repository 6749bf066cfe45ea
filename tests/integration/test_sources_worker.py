"""A real worker given runs whose corpora lie outside the corpus roots (stored straight
into the database, past the submit check) fails them without naming the path and
copies nothing into the corpus cache (security finding 2)."""

from __future__ import annotations

from pathlib import Path

from core.spec import parse_spec
from db.engine import transaction
from jobs import lifecycle
from jobs.service import new_study

SECRET = "outside-secret-4711"


def _store(url: str, corpus: str) -> int:
    """A queued run of a study reading ``corpus``, as if submit had let it through."""
    spec = parse_spec(
        {
            "name": "sneaky",
            "model": "tiny",
            "task": {"name": "lm", "corpus": corpus},
            "train": {"length": 16, "steps": 2, "batch_size": 2},
            "encodings": ["nope"],
            "eval": {"lengths": [16], "tokens": 64, "order_probe": False},
        }
    )
    with transaction(url) as session:
        study = new_study(spec, "tester")
        session.add(study)
        session.flush()
        (run_spec,) = spec.runs()
        run = lifecycle.submit(study, spec, run_spec, skip_cache=True)
        session.add(run)
        session.flush()
        return run.id


def test_a_worker_refuses_corpora_outside_the_roots(
    cluster_factory, sqlite_url: str, tmp_path: Path
) -> None:
    cluster = cluster_factory(sqlite_url)
    outside = tmp_path / SECRET
    outside.mkdir()
    (outside / "passwords.txt").write_text("hunter2 " * 300)
    root = cluster.home / "corpora"  # the default root: <home>/corpora
    root.mkdir()
    (root / "link").symlink_to(outside / "passwords.txt")
    corpora = [
        "text:/proc/self/environ",
        "text:/",
        f"text:{root}/../../{SECRET}/passwords.txt",
        f"text:{root}/link",
        "hf:wikitext",
    ]
    ids = [_store(cluster.settings.database, corpus) for corpus in corpora]
    cluster.start_worker()
    for run_id in ids:
        cluster.send(run_id)
    runs = cluster.wait_for(
        lambda runs: len(runs) == len(ids) and all(r.status == "failed" for r in runs),
        what="every run failed",
    )
    for run, corpus in zip(runs, corpora, strict=True):
        reason = run.failure_reason or ""
        assert reason.startswith("corpus "), reason
        assert "\n" not in reason
        for leak in (SECRET, "passwords", "environ", "/proc"):
            assert leak not in reason, (corpus, reason)
    cache = cluster.home / "cache" / "corpora"
    assert not cache.exists() or not any(cache.iterdir())
