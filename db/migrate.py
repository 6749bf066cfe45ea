"""Schema migrations: Alembic owns every change (``posbench db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection

from core.errors import UnavailableError
from db.engine import engine_for, normalize_url

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # '%' would be read as interpolation by configparser.
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


class DatabaseEncodingError(UnavailableError):
    """A PostgreSQL database that does not store text as UTF-8."""


def check_encoding(engine) -> None:
    """A PostgreSQL database must be UTF8: names, labels and failure reasons are UTF-8
    text, and on a SQL_ASCII one the driver hands SQLAlchemy bytes from its very first
    query ("cannot use a string pattern on a bytes-like object"). So the server's
    encoding is read from the connection's start-up parameters, before any query."""
    if engine.dialect.name != "postgresql":
        return
    arguments, options = engine.dialect.create_connect_args(engine.url)
    with engine.dialect.loaded_dbapi.connect(*arguments, **options) as raw:
        encoding, name = raw.info.parameter_status("server_encoding"), raw.info.dbname
    if str(encoding).upper().replace("-", "") != "UTF8":
        raise DatabaseEncodingError(
            f"the database {name} is encoded {encoding}; posbench needs UTF8: create it "
            f"with CREATE DATABASE {name} ENCODING 'UTF8' TEMPLATE template0 (or a cluster "
            "made with initdb --encoding=UTF8)"
        )


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision`` (creating it if needed); a
    PostgreSQL database that is not UTF8 is refused first, with how to make one."""
    engine = engine_for(normalize_url(url))
    check_encoding(engine)
    with engine.begin() as connection:
        upgrade_in(connection, revision)


def upgrade_in(connection: Connection, revision: str = "head") -> None:
    """Bring the database of ``connection`` to ``revision`` inside the transaction the
    caller holds: the migrations commit or roll back with whatever else it does."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
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
