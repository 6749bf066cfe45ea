"""The errors a person causes, as every entry point shows them.

A ``UserError`` is what a person's input or surroundings caused: a bad spec, a refused
model folder, a missing file, a quota, an unreachable service. The CLI prints it as one
line (``error: ...``) and exits with its ``exit_code`` (2: the input was wrong; 1: the
surroundings failed), the dashboard shows it as a message, and a worker records it as the
run's failure reason. Anything else that escapes is a bug in posbench, and each entry
point says so (the CLI with the traceback and a request to report it).

The lowest layer: every other module may raise one.
"""

from __future__ import annotations


class UserError(Exception):
    """Shown as one line, never as a traceback."""

    exit_code = 2


class UnavailableError(UserError):
    """Something posbench needs did not answer or failed (the broker, a backup tool,
    the disk): not the input's fault."""

    exit_code = 1
