"""Stage 3, recover: what the watchdog does about a verdict, and what survives a crash.

``watchdog`` is the facade the step calls, composed of ``save_policy`` (when a step is healthy
and a save due), ``saver`` (one interface over synchronous and staged saves), ``rollback_policy``
(LR back-off, skipped batches, loop guard), ``resume_policy`` (whether a folder that holds a run
is continued) and the ``ledger``; ``groups`` keeps the process's gloo groups of the background
writes (made once, reused by every agent); ``checkpoint`` writes and verifies healthy
checkpoints (DCP shards, manifest, atomic commit), with ``manifest`` (the signed file list,
verified), ``shards`` (the model's and optimizer's state, DCP's shards and plain JSON) and
``agreement`` (every rank fails a phase alike);
``snapshot`` stages a rank's state in host memory and restores it; ``staged`` keeps the last
committed copy (the in-memory rollback target) and starts the writes that ``async_save`` runs in
the background and settles in the same step on every rank;
``ledger`` is the job's durable record (rollbacks, LR scale, skipped batches; torch-free, the
supervisor reads it); ``carried`` is the watchdog's state a framework's own checkpoint carries
(torchtitan's); ``batches`` draws the loader's batches past the skipped ones; ``rng``,
``durable`` are their pieces; ``heartbeat`` and ``directives`` are the job's side of the
contracts with the supervisor and the collector. May import ``..measure``, ``..detect``,
``..report``, ``..config``; nothing from outputs.
"""
