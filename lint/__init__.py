"""posbench's own import-linter contract types (configured in pyproject.toml)."""
