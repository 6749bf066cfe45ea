"""One settings object, read from ``POSBENCH_*`` environment variables.

| variable | default | meaning |
|---|---|---|
| POSBENCH_HOME | .posbench | state of the embedded default |
| POSBENCH_DATABASE_URL | sqlite:///<home>/posbench.db | results database (SQLite or PostgreSQL) |
| POSBENCH_BROKER_URL | the private Redis of `posbench up` | Celery broker (Redis) |
| POSBENCH_ARTIFACTS | <home>/artifacts | checkpoints (a folder or a file:// URL) |
| POSBENCH_CACHE_DIR | <home>/cache | prepared corpora |
| POSBENCH_DEVICE | cuda if available, else cpu | torch device of workers |
| POSBENCH_HEARTBEAT_SECONDS | 5 | how often a running run proves it is alive |
| POSBENCH_STALE_AFTER_SECONDS | 30 | a running run silent this long is requeued |
| POSBENCH_RECONCILE_SECONDS | 10 | how often each worker looks for stranded runs |
| POSBENCH_MAX_ATTEMPTS | 3 | a run whose worker died this many times fails |
| POSBENCH_PIN_GPUS | false | pin pool process i to GPU i (CUDA_VISIBLE_DEVICES) |
| POSBENCH_VISIBILITY_TIMEOUT | 172800 | Redis redelivers an unacknowledged message after this |
| POSBENCH_DASHBOARD_PASSWORD | unset | when set, the dashboard asks for it (the operator role) |
| POSBENCH_DASHBOARD_VIEWER_PASSWORD | unset | a password that opens the dashboard read-only |
| POSBENCH_DASHBOARD_SESSION_HOURS | 12 | a dashboard login lasts this long |
| POSBENCH_DASHBOARD_OPERATORS | unset | OIDC: e-mails or @domains with the operator role (',') |
| POSBENCH_DASHBOARD_VIEWERS | unset | OIDC: e-mails or @domains with the viewer role (',') |
| POSBENCH_DASHBOARD_TRUSTED_PROXIES | unset | proxies whose X-Forwarded-For is believed (',') |
| POSBENCH_DASHBOARD_WRONG_PASSWORDS_PER_MINUTE | 30 | most wrong passwords a minute, all clients |
| POSBENCH_CORPUS_ROOTS | <home>/corpora | folders a text: corpus may come from (':'-separated) |
| POSBENCH_CORPUS_MAX_FILE_BYTES | 268435456 (256 MiB) | a larger text: corpus file is refused |
| POSBENCH_CORPUS_MAX_TOTAL_BYTES | 1073741824 (1 GiB) | a larger corpus (in all) is refused |
| POSBENCH_HF_DATASETS | false | whether hf: corpora and hub models (model.hf) may be loaded |
| POSBENCH_HF_ALLOW | unset | when set, the only hf: datasets and hub models allowed (',') |
| POSBENCH_MODELS_ROOTS | <home>/models | folders a model.hf folder may come from (':'-separated) |
| POSBENCH_MAX_HF_PARAMETERS | 8000000000 | a model.hf of more parameters (its config) is refused |
| POSBENCH_MAX_STUDY_FLOPS | 1e19 | a study estimated above this (training, evaluation) is refused |
| POSBENCH_MAX_ACTIVE_RUNS | 32 | most runs queued or running; a study over it is refused |
| POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER | 16 | the same, for the runs of one submitter's studies |
| POSBENCH_RUN_DEADLINE_HOURS | 24 | a run this long since it started fails (wall clock) |
| POSBENCH_MIN_CHECKPOINT_SECONDS | 60 | least time between a worker's periodic checkpoints |
| POSBENCH_MAX_CHECKPOINT_BYTES | 4294967296 (4 GiB) | a study with larger checkpoints is refused |
| POSBENCH_MAX_ARTIFACTS_BYTES | 214748364800 (200 GiB) | the artifacts folder's budget (0: none) |
| POSBENCH_MAX_CACHE_BYTES | 17179869184 (16 GiB) | corpora cached past it: LRU eviction (0: none) |
| POSBENCH_DELETE_RETENTION_DAYS | 7 | a deleted study can be restored this long, then is purged |
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.catalog.corpora import MiB, SourcePolicy, forbidden
from core.catalog.hf_models import ModelPolicy

BROKER_SCHEMES = ("redis", "rediss", "redis+socket")
DATABASE_BACKENDS = ("sqlite", "postgresql")
DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
HOUR, DAY, WEEK = 3600, 86_400, 7 * 86_400
GiB, TiB, PiB = 1 << 30, 1 << 40, 1 << 50


class Settings(BaseSettings):
    # An empty variable (KEY= in an env file, ${X:-} in compose) means "unset".
    model_config = SettingsConfigDict(env_prefix="POSBENCH_", extra="ignore", env_ignore_empty=True)

    home: Path = Field(Path(".posbench"), description="state of the embedded default")
    database_url: str | None = Field(None, description="SQLAlchemy URL of the results database")
    broker_url: str | None = Field(None, description="Celery broker URL (Redis)")
    artifacts: str | None = Field(None, description="where checkpoints are written")
    cache_dir: Path | None = Field(None, description="prepared corpora")
    device: str | None = Field(None, description="torch device of workers")
    heartbeat_seconds: float = Field(5.0, gt=0, le=HOUR)
    stale_after_seconds: float = Field(30.0, gt=0, le=WEEK)
    reconcile_seconds: float = Field(10.0, gt=0, le=DAY)
    max_attempts: int = Field(
        3, ge=1, le=100, description="a run whose worker died this often fails"
    )
    hang_seconds: float = Field(
        3600.0, ge=0, le=30 * DAY, description="a run without progress this long is hung (0: never)"
    )
    pin_gpus: bool = Field(False, description="pin each pool process to its own GPU")
    # Longer than the longest allowed run, so Redis never redelivers a message
    # whose run is still training; the reconciler handles dead workers sooner.
    visibility_timeout: int = Field(172_800, ge=HOUR, le=30 * DAY)
    dashboard_password: SecretStr | None = None
    dashboard_viewer_password: SecretStr | None = Field(
        None, description="a password that opens the dashboard read-only"
    )
    dashboard_session_hours: float = Field(12.0, gt=0, le=30 * 24, description="login lifetime")
    dashboard_operators: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="OIDC e-mails or @domains with the operator role"
    )
    dashboard_viewers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="OIDC e-mails or @domains with the viewer role"
    )
    # Uvicorn believes X-Forwarded-For from these peers only (jobs.embedded passes them
    # on); its own default trusts loopback, and a forged header then named the client.
    dashboard_trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="addresses or networks of proxies whose X-Forwarded-For is believed",
    )
    dashboard_wrong_passwords_per_minute: int = Field(
        30, ge=1, le=10_000, description="wrong passwords checked per minute, all clients"
    )
    corpus_roots: Annotated[list[Path] | None, NoDecode] = Field(
        None, description="folders a text: corpus may come from (default: <home>/corpora)"
    )
    corpus_max_file_bytes: int = Field(256 * MiB, ge=1, description="largest corpus file")
    corpus_max_total_bytes: int = Field(1024 * MiB, ge=1, description="largest corpus in all")
    hf_datasets: bool = Field(
        False, description="whether hf: corpora and hub models (model.hf) may be loaded"
    )
    hf_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="the only hf: datasets and hub models allowed (empty: any)",
    )
    models_roots: Annotated[list[Path] | None, NoDecode] = Field(
        None, description="folders a model.hf folder may come from (default: <home>/models)"
    )
    max_hf_parameters: int = Field(
        8_000_000_000,
        ge=1,
        le=10**13,
        description="largest model.hf, in parameters its config describes (read before loading)",
    )

    # Quotas: what one accepted spec may cost the service (jobs.quotas, the worker).
    max_study_flops: float = Field(
        1e19, gt=0, le=1e30, description="largest estimated compute of one study (FLOPs)"
    )
    max_active_runs: int = Field(
        32, ge=1, le=100_000, description="most runs queued or running across the service"
    )
    max_active_runs_per_submitter: int = Field(
        16, ge=1, le=100_000, description="most runs queued or running of one submitter"
    )
    run_deadline_hours: float = Field(
        24.0, gt=0, le=30 * 24, description="a run this long since it started fails"
    )
    min_checkpoint_seconds: float = Field(
        60.0, ge=0, le=DAY, description="least time between a worker's periodic checkpoints"
    )
    # Disk: one run's checkpoint (at submit), the artifacts folder (at submit and on the
    # worker) and the prepared-corpus cache (evicted by the reader).
    max_checkpoint_bytes: int = Field(
        4 * GiB, ge=MiB, le=TiB, description="largest estimated checkpoint of one run"
    )
    max_artifacts_bytes: int = Field(
        200 * GiB, ge=0, le=PiB, description="the artifacts folder's budget (0: none)"
    )
    max_cache_bytes: int = Field(
        16 * GiB, ge=0, le=PiB, description="the prepared-corpus cache's bound (0: none)"
    )
    # Soft delete (jobs.retention): restorable this long, then purged by the reconciler.
    delete_retention_days: float = Field(
        7.0, ge=0, le=3650, description="how long a deleted study can be restored"
    )

    @field_validator(
        "corpus_roots", "models_roots", "hf_allow", "dashboard_trusted_proxies", mode="before"
    )
    @classmethod
    def _split(cls, value: Any, info) -> Any:
        # From the environment: a JSON list, or names separated by ':' (roots, like
        # PATH) or ',' (datasets).
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        separator = os.pathsep if info.field_name.endswith("_roots") else ","
        return [part.strip() for part in value.split(separator) if part.strip()]

    @field_validator("dashboard_operators", "dashboard_viewers", mode="before")
    @classmethod
    def _split_allow_list(cls, value: Any) -> Any:
        # From the environment: a JSON list, or e-mails / @domains separated by ','.
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [part.strip().lower() for part in value.split(",") if part.strip()]

    @field_validator("dashboard_trusted_proxies")
    @classmethod
    def _trusted_proxies(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            try:
                ipaddress.ip_network(entry)  # an address is a network of one
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network (e.g. 10.0.0.5, "
                    "10.0.0.0/24 or fd00::/64, without host bits after the /)"
                ) from None
        return entries

    @field_validator("corpus_roots", "models_roots")
    @classmethod
    def _corpus_roots(cls, roots: list[Path] | None) -> list[Path] | None:
        for root in roots or ():
            resolved = root.expanduser().resolve()
            if forbidden(resolved) or resolved == Path(resolved.anchor):
                raise ValueError(
                    "must not be the file system's root, /proc, /sys or /dev (or inside them)"
                )
        return roots

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, url: str | None) -> str | None:
        if url is None:
            return url
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            parsed = make_url(url)
            backend = parsed.get_backend_name()
        except (ArgumentError, ValueError):  # ValueError: a port that is not a number
            parsed = backend = None
        if backend not in DATABASE_BACKENDS and backend != "postgres":
            raise ValueError(
                "must be an SQLAlchemy URL of SQLite or PostgreSQL, e.g. sqlite:///posbench.db "
                "or postgresql://user:password@host/posbench"
            )
        if backend == "sqlite" and parsed.database in (None, "", ":memory:"):
            raise ValueError(
                "must name a database file: an in-memory SQLite database is private to one "
                "process, and the service's processes share the results"
            )
        return url

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, url: str | None) -> str | None:
        scheme = None if url is None else url.partition("://")[0]
        if url is not None and ("://" not in url or scheme not in BROKER_SCHEMES):
            raise ValueError(
                f"must be a Redis URL ({', '.join(s + '://' for s in BROKER_SCHEMES)}), "
                "e.g. redis://localhost:6379/0"
            )
        if url is not None and scheme != "redis+socket":
            try:
                _ = urlsplit(url).port  # raises on a port that is not a number
            except ValueError:
                raise ValueError(
                    "has a port that is not a number from 0 to 65535, e.g. redis://host:6379/0"
                ) from None
        return url

    @field_validator("artifacts")
    @classmethod
    def _artifacts(cls, location: str | None) -> str | None:
        if location is not None and "://" in location and not location.startswith("file://"):
            raise ValueError(
                "must be a folder or a file:// URL (object stores are not supported; mount "
                "one as a folder)"
            )
        if location is not None and not location.removeprefix("file://").strip():
            raise ValueError("must name a folder, e.g. file:///data/posbench or /data/posbench")
        return location

    @field_validator("device")
    @classmethod
    def _device(cls, device: str | None) -> str | None:
        if device is not None and not DEVICE.match(device):
            raise ValueError("must be cpu, cuda, cuda:N or mps")
        return device

    @model_validator(mode="after")
    def _timings(self) -> Settings:
        if self.stale_after_seconds < 2 * self.heartbeat_seconds:
            raise ValueError(
                f"POSBENCH_STALE_AFTER_SECONDS = {self.stale_after_seconds:g} must be at least "
                f"twice POSBENCH_HEARTBEAT_SECONDS = {self.heartbeat_seconds:g}, or healthy "
                "runs would be requeued"
            )
        if self.visibility_timeout <= self.run_deadline_seconds:
            raise ValueError(
                f"POSBENCH_VISIBILITY_TIMEOUT = {self.visibility_timeout} s must be longer "
                f"than POSBENCH_RUN_DEADLINE_HOURS = {self.run_deadline_hours:g} h "
                f"({self.run_deadline_seconds:g} s), or Redis would hand a run still "
                "training to a second worker"
            )
        return self

    @property
    def run_deadline_seconds(self) -> float:
        return self.run_deadline_hours * HOUR

    @property
    def sources(self) -> SourcePolicy:
        """The rules on corpora, for the spec's check at submit and the reader."""
        roots = self.corpus_roots if self.corpus_roots is not None else [self.home / "corpora"]
        return SourcePolicy(
            roots=tuple(dict.fromkeys(root.expanduser().resolve() for root in roots)),
            max_file_bytes=self.corpus_max_file_bytes,
            max_total_bytes=self.corpus_max_total_bytes,
            hf_enabled=self.hf_datasets,
            hf_allow=tuple(self.hf_allow),
            max_cache_bytes=self.max_cache_bytes or None,
        )

    @property
    def models(self) -> ModelPolicy:
        """The rules on hf: models (model.hf), for the spec's check at submit and the
        loader: folders in the models roots; hub ids under the hf: corpora's switch and
        allow-list."""
        roots = self.models_roots if self.models_roots is not None else [self.home / "models"]
        return ModelPolicy(
            roots=tuple(dict.fromkeys(root.expanduser().resolve() for root in roots)),
            hub_enabled=self.hf_datasets,
            hub_allow=tuple(self.hf_allow),
            max_parameters=self.max_hf_parameters,
        )

    @property
    def corpus_cache(self) -> Path:
        return self.cache_dir or self.home / "cache"

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'posbench.db').resolve()}"

    @property
    def redis_socket(self) -> Path:
        return (self.home / "redis" / "redis.sock").resolve()

    @property
    def broker(self) -> str:
        return self.broker_url or f"redis+socket://{self.redis_socket}"

    @property
    def artifacts_dir(self) -> Path:
        location = self.artifacts or str(self.home / "artifacts")
        return Path(location.removeprefix("file://")).resolve()


def describe_settings_error(error: ValidationError) -> str:
    """One line per problem, named by its environment variable."""
    lines = []
    for problem in error.errors(include_url=False):
        message = problem["msg"].removeprefix("Value error, ")
        if problem["loc"]:
            field = str(problem["loc"][0])
            variable = "POSBENCH_" + field.upper()
            # URLs may carry a password: name them, never echo them.
            shown = "" if field.endswith("url") else f" = {problem.get('input')!r}"
            lines.append(f"{variable}{shown}: {message}")
        else:
            lines.append(message)
    return "; ".join(lines)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
