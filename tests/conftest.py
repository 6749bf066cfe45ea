from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Isolate every test process: its own posbench home (prepared corpora) and an
# offline HuggingFace cache. Set before anything reads them.
os.environ["POSBENCH_HOME"] = tempfile.mkdtemp(prefix="posbench-test-")
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="posbench-hf-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch

if TYPE_CHECKING:
    from core.settings import Settings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per test process: with several workers on few cores,
    # OpenMP threads spinning against each other make every step many times slower.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _dashboard_on_loopback() -> Iterator[None]:
    """AppTest serves nothing, but Streamlit's server.address is unset in a test process,
    which a real server reads as every interface: the dashboard's gate would close when
    no login is configured. Tests that use Streamlit see it bound as `posbench dashboard`
    binds it, 127.0.0.1, unless they set it themselves."""
    if "streamlit" not in sys.modules:  # imported by every test module that uses it
        yield
        return
    from streamlit import config

    previous = config.get_option("server.address")
    config.set_option("server.address", "127.0.0.1")
    try:
        yield
    finally:
        config.set_option("server.address", previous)


def dims(n_heads: int = 4, head_dim: int = 16, train_length: int = 32) -> dict[str, int]:
    return {
        "n_heads": n_heads,
        "head_dim": head_dim,
        "d_model": n_heads * head_dim,
        "train_length": train_length,
    }


def loss_gradients(model, forward, tokens) -> dict:
    """Every parameter's gradient of the next-byte loss of ``forward(tokens)`` (the model
    itself, or a reference that computes the same logits from its weights)."""
    import torch.nn.functional as F

    model.zero_grad()
    logits = forward(tokens)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


ROOT = Path(__file__).resolve().parents[1]


def dashboard_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """For a dashboard fixture: its own home and migrated SQLite database, no login set up
    (every POSBENCH_DASHBOARD_* unset), served on 127.0.0.1 (as `_dashboard_on_loopback`
    does when the test module imported Streamlit itself: a page's fragments check the
    bind too), the settings read afresh before and after."""
    from streamlit import config as streamlit_config

    from core.settings import Settings, get_settings
    from db.migrate import upgrade

    for name in list(os.environ):
        if name.startswith("POSBENCH_DASHBOARD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("POSBENCH_HOME", str(tmp_path))
    monkeypatch.setenv("POSBENCH_DATABASE_URL", f"sqlite:///{tmp_path}/dash.db")
    get_settings.cache_clear()
    config = Settings()
    upgrade(config.database)
    bound = streamlit_config.get_option("server.address")
    streamlit_config.set_option("server.address", "127.0.0.1")
    yield config
    streamlit_config.set_option("server.address", bound)
    get_settings.cache_clear()


OIDC_SECRETS = """\
[auth]
redirect_uri = "https://dashboard.example.org/oauth2callback"
cookie_secret = "not-a-real-cookie-secret"
client_id = "posbench"
client_secret = "not-a-real-client-secret"
server_metadata_url = "https://login.example.org/.well-known/openid-configuration"
"""


def oidc_secrets(folder: Path) -> Path:
    """An OIDC login (an ``[auth]`` section) in ``folder``/.streamlit/secrets.toml: where
    Streamlit and `posbench dashboard` look when ``folder`` is the working directory."""
    path = folder / ".streamlit" / "secrets.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OIDC_SECRETS)
    return path


def oidc_login(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, operators: str = "", viewers: str = ""
) -> Iterator[Path]:
    """For a dashboard fixture (after ``dashboard_settings``): an OIDC login configured in
    the working directory ``tmp_path``, with these allow-lists. Streamlit's own parse of
    the secrets is emptied before and after: it keeps the first one it reads."""
    from streamlit.runtime.secrets import secrets_singleton

    from core.settings import get_settings

    secrets = oidc_secrets(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSBENCH_DASHBOARD_OPERATORS", operators)
    monkeypatch.setenv("POSBENCH_DASHBOARD_VIEWERS", viewers)
    get_settings.cache_clear()
    secrets_singleton._reset()
    yield secrets
    secrets_singleton._reset()
    get_settings.cache_clear()


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """This process' environment with no posbench setting but ``home`` (and ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    return {**env, "POSBENCH_HOME": str(home), **extra}


def posbench_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``posbench ARGS`` in a real subprocess from the project root (``input`` on stdin)."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


# A study of four tiny runs (two encodings x two seeds), for the service's tests.
FOUR_RUNS = {
    "model": "tiny",
    "train": {"length": 16, "steps": 4, "batch_size": 2},
    "encodings": ["rope", "alibi"],
    "seeds": [0, 1],
    "eval": {"lengths": [16, 32]},
}


def service_settings(tmp_path: Path, **values: Any) -> Settings:
    """Settings on a fresh SQLite database under ``tmp_path``, migrated to the latest
    schema (``values`` override any other setting)."""
    from core.settings import Settings
    from db.migrate import upgrade

    config = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/test.db", **values)
    upgrade(config.database)
    return config


def study_results(spec: dict[str, Any], device: str | None = None) -> dict[str, Any]:
    """The results.json document `posbench run` writes for ``spec``, run in this process
    (on ``device``, or this machine's default)."""
    from core.settings import get_settings
    from core.spec import parse_spec
    from worker.run import prepared_task, resolve_device, run_study

    parsed, settings = parse_spec(spec), get_settings()
    task = prepared_task(parsed, settings.corpus_cache)
    chosen = resolve_device(default=device or settings.device)
    return run_study(parsed, task=task, device=chosen).to_dict()


def worker_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str
) -> Iterator[Settings]:
    """For a fixture: the settings the worker runtime reads (get_settings) on a fresh
    database, on the CPU with a one-hour deadline (``env``: more POSBENCH_* variables)."""
    from core import settings as settings_module

    values = {
        "POSBENCH_HOME": str(tmp_path),
        "POSBENCH_DATABASE_URL": f"sqlite:///{tmp_path}/test.db",
        "POSBENCH_DEVICE": "cpu",
        "POSBENCH_RUN_DEADLINE_HOURS": "1",
        **env,
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    settings_module.get_settings.cache_clear()
    yield service_settings(tmp_path, device="cpu", run_deadline_hours=1)
    settings_module.get_settings.cache_clear()


def two_encodings_frame(metric: str, value: Callable[[str, int, int], float | None]):
    """Curves rows (as ``db.queries.curves`` gives them) of three seeds each of alibi and
    rope at 128, 256 and 512, ``value(label, seed, length)`` as ``metric``: for tests of
    summaries and pairwise claims on a metric."""
    import pandas as pd

    rows = []
    runs = [(label, seed) for label in ("alibi", "rope") for seed in range(3)]
    for run_id, (label, seed) in enumerate(runs):
        for length in (128, 256, 512):
            rows.append(
                {
                    "study_id": 1,
                    "run_id": run_id,
                    "label": label,
                    "seed": seed,
                    "variant": "none",
                    "protocol": "nonoverlapping",
                    "eval_length": length,
                    metric: value(label, seed, length),
                    "not_applicable": None,
                }
            )
    return pd.DataFrame(rows)


def digest_in_another_process(module: str, argument: Any) -> str:
    """``module``'s ``digest(argument)`` computed by a fresh interpreter (``argument``
    goes as JSON): what examples drawn in another process hash to."""
    code = (  # the test modules import conftest, as pytest lets them
        f"import json, sys\nsys.path.insert(0, 'tests')\nfrom {module} import digest\n"
        "print(digest(json.loads(sys.argv[1])))\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argument)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return other.stdout.strip()


# The fast tier (`make test-fast`, -m "not slow"): a test is slow when it starts real
# processes (servers, browsers, workers, the posbench CLI) or trains or compiles for more
# than a few seconds. The first kind is found here, by what the test uses; the second is
# marked by hand (@pytest.mark.slow, from `pytest --durations`).
PROCESS_CALLS = ("posbench_cli(", "posbench(", "subprocess.", "Popen(", "AppTest.")
PROCESS_FIXTURES = {"redis_url", "postgres_server", "cluster_factory", "home_with_models"}


def _starts_processes(item: pytest.Item) -> bool:
    import inspect

    if "integration" in item.path.parts:
        return True
    if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return any(call in source for call in PROCESS_CALLS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)
