"""Each rank's /metrics target in a Prometheus ``file_sd`` folder, so a fallback port is found.

    TORCHVITALS_METRICS_FILE_SD_DIR=/shared/tv-targets torchrun ... train.py
    # prometheus.yml
    scrape_configs:
      - job_name: torchvitals
        file_sd_configs: [{files: ["/shared/tv-targets/*.json"]}]

A rank writes one file, ``<host>-rank<rank>.json``, holding the ``host:port`` it really serves
(the configured port, or the one it fell back to when that was taken), and removes it when the
agent closes. Prometheus watches the folder and scrapes whatever the files name. Its labels are
``__scheme__`` (https with TLS) and, when the job obeys a collector, ``job``: the alerts carry
the job label and the collector addresses its directives by it. Never ``rank``: the exporter's
own series carry it, and a target label of the same name would rename them ``exported_rank``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

from ...records.durable import replace_json

log = logging.getLogger(__name__)


class TargetFile:
    """One rank's entry in a file_sd folder.

    Args:
        folder: the folder Prometheus' ``file_sd_configs`` reads (created when missing).
        rank: the global rank (in the file's name, so ranks of one host never clash).
        host: the host name in the file's name (default: this machine's).
    """

    def __init__(self, folder: str | os.PathLike, rank: int, host: str | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"{host or socket.gethostname()}-rank{rank:05d}.json"
        self.written = False

    def write(self, target: str, scheme: str = "http", job: str | None = None) -> bool:
        """Publish ``target`` (``host:port``); whether it was written. Never raises: a folder
        that cannot be written is a warning, and the training goes on.

        Args:
            target: ``host:port`` the rank serves.
            scheme: "https" when /metrics serves TLS.
            job: the ``job`` label the series should get (the collector's job name), or None
                for the scrape config's job name.
        """
        labels = {"__scheme__": scheme} if scheme != "http" else {}
        if job:
            labels["job"] = job
        try:
            # Renamed into place: Prometheus re-reads a changed file and must never see half.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_json(self.path, [{"targets": [target], "labels": labels}])
        except OSError as exc:
            log.warning(
                "torchvitals: cannot write the file_sd target %s (%s); Prometheus will "
                "not find this rank's /metrics through it",
                self.path,
                exc,
            )
            return False
        self.written = True
        return True

    def remove(self) -> None:
        """Take the target away (the rank no longer serves); safe to call twice."""
        if not self.written:
            return
        self.written = False
        # Already gone, or a read-only folder: Prometheus drops a dead target.
        with contextlib.suppress(OSError):
            self.path.unlink()
