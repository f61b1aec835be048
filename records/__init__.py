"""The job's records on disk, and their vocabulary: torch-free, and importing nothing from the
agent, so the agent, the supervisor and the commands that read a job's folder share them.

- ``vocabulary``: what a step did (``Action``) and the kinds of incident;
- ``schema``: the timeline's record keys and the schema version every record carries;
- ``durable``: the one way a record file is written (fsynced, replaced atomically);
- ``incidents``: one file per disruption, written once;
- ``timeline``: the steps and the supervisors' attempts, appended line by line;
- ``goodput``: the accounting computed from the timeline and the incidents;
- ``ledger``: the checkpoints, rollbacks and skipped batches of the job (the rollback target);
- ``jobid``: the job's identity, which a resume must match.
"""
