"""Stage 3, recover: what the watchdog does about a verdict, and what survives a crash.

``watchdog`` decides (healthy checkpoint, rollback with LR back-off, loop guard, abort);
``checkpoint`` writes and verifies healthy checkpoints (DCP shards, manifest, atomic commit);
``snapshot`` stages a rank's state in host memory and restores it; ``staged`` keeps the last
committed copy (the in-memory rollback target) and starts the writes that ``async_save`` runs in
the background and settles in the same step on every rank;
``ledger`` is the job's durable record (rollbacks, LR scale, skipped batches; torch-free, the
supervisor reads it); ``batches`` draws the loader's batches past the skipped ones; ``rng``,
``durable`` are their pieces; ``heartbeat`` and ``directives`` are the job's side of the
contracts with the supervisor and the collector. May import ``..measure``, ``..detect``,
``..report``, ``..config``; nothing from outputs.
"""
