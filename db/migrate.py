"""Schema migrations: Alembic owns every change (``posbench db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from db.engine import engine_for, normalize_url

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # '%' would be read as interpolation by configparser.
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision`` (creating it if needed)."""
    config = alembic_config(url)
    with engine_for(normalize_url(url)).begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def downgrade(url: str, revision: str) -> None:
    """Take the database at ``url`` back to ``revision``."""
    config = alembic_config(url)
    with engine_for(normalize_url(url)).begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def current(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine_for(normalize_url(url)).connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def known_revisions() -> set[str]:
    """Every schema revision this code's migrations know (a restored database must be at
    one of them: Alembic cannot migrate from a revision it has never seen)."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory(str(MIGRATIONS))
    return {script.revision for script in scripts.walk_revisions()}


def head() -> str:
    """The latest schema revision."""
    from alembic.script import ScriptDirectory

    found = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    assert found is not None, "no migrations"
    return found
