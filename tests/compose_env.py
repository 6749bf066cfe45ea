"""Compose's variable interpolation and `.env` reading, as `docker compose` does them
(the subset docker-compose.yml uses), so the tests can render the file an operator's
`.env` yields without a Docker engine.

- ``${VAR}`` / ``$VAR``: the value, empty when unset.
- ``${VAR:-default}``: the default when unset or empty; ``${VAR-default}``: when unset.
- ``${VAR:?message}``: an error when unset or empty; ``${VAR?message}``: when unset.
- ``$$``: a literal ``$``.
"""

from __future__ import annotations

import re
from pathlib import Path

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))"
)


class InterpolationError(ValueError):
    """What `docker compose` reports before it starts anything."""


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blank lines skipped, quotes stripped)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def interpolate(text: str, env: dict[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"], match["arg"]
        value = env.get(name)
        missing = value is None or (op is not None and op.startswith(":") and value == "")
        if op and op.endswith("?") and missing:
            raise InterpolationError(f"required variable {name} is missing a value: {arg}")
        if op and op.endswith("-") and missing:
            return arg
        return value or ""

    return _VARIABLE.sub(substitute, text)
