"""``torchvitals supervise``: the command around a ``Supervisor``: its /metrics, the signals
passed on to the job, and the exit status.

    torchvitals supervise --metrics-port 9501 --checkpoint-dir ckpt -- torchrun ... train.py
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence

from .etcd import StoreError
from .options import SupervisorConfig
from .supervisor import Supervisor

log = logging.getLogger("torchvitals.supervisor")


def supervise(config: SupervisorConfig, command: Sequence[str]) -> int:
    """Run ``command`` under ``config``, with /metrics when configured and SIGTERM/SIGINT
    passed on to the job's process group.

    Returns:
        The exit status (0, ``abort_exit_code``, ``no_progress_exit_code``,
        ``budget_exit_code``, ``refused_exit_code``, ``node_lost_exit_code``, 1 when the job's
        store stopped answering or refused us, 2 for a job of several nodes without a job id or
        an unreadable store TLS or password file, or 128 + the signal that stopped the
        supervisor).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        supervisor = Supervisor(config, command)
    except ValueError as exc:
        log.error("torchvitals supervise: %s", exc)
        return 2
    if config.metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(
                config.metrics_port,
                addr=config.metrics_host,
                registry=supervisor.metrics.registry,
                certfile=config.metrics_certfile,
                keyfile=config.metrics_keyfile,
                client_cafile=config.metrics_client_cafile,
                client_auth_required=bool(config.metrics_client_cafile),
            )
        except OSError as exc:  # a taken port or a bad certificate: watch the job anyway
            log.error(
                "torchvitals supervise: no /metrics on %s:%d (%s); supervising without",
                config.metrics_host,
                config.metrics_port,
                exc,
            )

    class _Stopped(Exception):
        pass

    def on_signal(signum, frame):
        raise _Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return supervisor.run()
    except StoreError as exc:
        log.error(
            "torchvitals supervise: the job's store does not answer (%s); stopping this node's job",
            exc,
        )
        supervisor.stop(1)
        return 1
    except _Stopped as stopped:
        log.warning("torchvitals supervise: signal %d; stopping the job", stopped.args[0])
        supervisor.stop(128 + stopped.args[0])
        return 128 + stopped.args[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
