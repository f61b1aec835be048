"""Replaying a past run's log through the live detector (``torchvitals backtest``).

``logs`` reads the log files (CSV, TSV, JSON lines, Megatron-LM's iteration lines; gzipped or
not) into one series of steps, ``eventfiles`` the TensorBoard event files; ``replay`` feeds each
step to the agent's own ``Detector`` and groups its verdicts into pages and warnings; ``plot``
draws the result. Torch-free: a laptop without torch can judge a cluster's logs.
"""
