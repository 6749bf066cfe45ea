"""``python -m cli``: the same as the ``posbench`` command."""

from cli import main

main()
