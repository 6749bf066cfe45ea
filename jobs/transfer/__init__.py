"""Results in and out of the database: ``posbench import`` of a ``results.json`` and
the export of finished runs to MLflow."""
