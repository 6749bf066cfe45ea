"""`python -m jobs.healthcheck`: exit 0 when the broker and the database answer.

The worker containers' healthcheck: a worker that cannot reach either is not healthy.
"""

from __future__ import annotations

import sys

from core.settings import get_settings


def main() -> int:
    settings = get_settings()
    try:
        from jobs.celery_app import producer

        with producer(settings).connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=5)
        from sqlalchemy import text

        from db.engine import engine_for, normalize_url

        with engine_for(normalize_url(settings.database)).connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as err:  # any failure means unhealthy; say which
        from core.safe_text import redact_urls
        from core.terminal import echo

        echo(f"unhealthy: {redact_urls(str(err))}", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
