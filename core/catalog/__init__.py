"""The catalogue: torch-free registries of what exists - position encodings
(:mod:`core.catalog.encodings`), RoPE scalings (:mod:`core.catalog.scalings`), tasks
(:mod:`core.catalog.tasks`) and model presets (:mod:`core.catalog.models`).

This is the lowest layer but one (only the metric registry, :mod:`core.metrics`, sits
below it): the spec, the CLI and the dashboard read it without loading torch, and each
entry carries its own validation hook, so no other module switches on a name.
"""
