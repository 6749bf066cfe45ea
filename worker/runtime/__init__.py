"""What a worker does with a run, as plain Python (``worker.tasks`` is only the Celery glue).

- ``execute``: run a claimed run to its end (train, evaluate, summarise, finish);
- ``cache``: the result cache's trained models (a run takes the model another run
  trained, or waits for it while it trains);
- ``store``: the results a claimed run writes, each guarded by its lease;
- ``heartbeat``: the thread that proves the run alive, and its hang watchdog;
- ``shutdown``: the signal that hands a run back when its worker stops.

Nothing here imports torch at import time: a pool process must start in seconds.
"""
