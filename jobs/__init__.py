"""The job model: study specs, validation, submission and the `posbench` CLI.

Nothing here imports torch at module level: producers enqueue by name.
"""
