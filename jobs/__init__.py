"""The queue, above the results database: submit, lifecycle, quotas, access, the
reconciler, backups, retention, routing and the Celery application.

Nothing here imports torch at module level: producers enqueue by name.
"""
