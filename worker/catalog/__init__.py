"""The catalogue: torch-free registries of what exists - position encodings
(:mod:`worker.catalog.encodings`), RoPE scalings (:mod:`worker.catalog.scalings`), tasks
(:mod:`worker.catalog.tasks`) and model presets (:mod:`worker.catalog.models`).

This is the lowest layer but one (only the metric registry, :mod:`jobs.metrics`, sits
below it): the spec, the CLI and the dashboard read it without loading torch, and each
entry carries its own validation hook, so no other module switches on a name.
"""
