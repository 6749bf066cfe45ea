"""One settings object, read from ``POSBENCH_*`` environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="POSBENCH_", extra="ignore")

    home: Path = Field(
        default=Path(".posbench"),
        description="Folder for the embedded default's state (database, broker, artifacts).",
    )
    cache_dir: Path | None = Field(
        default=None,
        description="Prepared corpora (uint8 memory maps keyed by content hash); "
        "default: <home>/cache.",
    )
    device: str | None = Field(
        default=None,
        description="Torch device for training and evaluation; default: cuda if "
        "available, else cpu.",
    )

    @property
    def corpus_cache(self) -> Path:
        return self.cache_dir or self.home / "cache"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
