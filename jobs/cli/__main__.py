"""``python -m jobs.cli``: the same as the ``posbench`` command."""

from jobs.cli import main

main()
