"""Stage 4, outputs: where each step's report goes, without adding a sync to the step.

``sinks`` opens and feeds them together: ``exporter`` (each rank's Prometheus /metrics, built at
scrape time from the table in ``metrics``), ``eventlog`` (JSON lines on global rank 0, and its
reader), ``live`` (the terminal view). May import ``..detect`` (pattern names), ``..report``,
``..config``; nothing from recover (the watchdog's numbers arrive as plain data).
"""
