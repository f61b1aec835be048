"""``torchvitals supervise``: run a training launcher, restart it when it crashes or hangs.

    torchvitals supervise --checkpoint-dir ckpt -- torchrun --nproc-per-node 8 train.py

One supervisor per node, a program of its own: it never imports the webhook service
(``torchvitals.collector``), the web stack or torch. ``supervisor`` is the loop over attempts;
``attempt`` runs one (``process`` starts the launcher tied to the supervisor and stops the
job's processes from outside, ``hang_clock`` tells a hang from the heartbeats, ``worker_groups``
follows torchrun's restarts of its workers) and ``outcomes`` says how it ended;
``restart_policy`` decides what comes next.

Each disruption is an incident naming its culprit: ``witness`` keeps what this node sees of an
attempt's ranks (``deaths`` when each process ended and how, ``death_marks`` the store's order
of those deaths, ``launcher_log`` torchrun's reports on its stderr, ``rank_probe`` their states
and stacks), recorded as ``rank_findings``; ``localizer`` turns a hang, a crash or a lost node
into its incident, on every node's findings, with the rules of ``blame`` naming the culprit;
``disruptions`` writes it with the node's goodput timeline, and ``goodput_export`` serves the
job's goodput.

The other nodes: ``peers`` is what a node asks of them (``SoloPeers`` when it is alone) and
``orders`` what they answer with; ``store_peers`` is their agreement through the job's etcd
(``barrier`` the start of an attempt, ``membership`` the nodes present, ``findings_exchange``
sharing the findings about an incident, ``job_store`` one job's keys read and written,
``store_schema`` the keys and the record under each, ``etcd`` the store's client).

``options`` holds its settings, ``telemetry`` its /metrics and ``command`` the CLI around it. It
talks to the job only through ``torchvitals.protocol`` (heartbeat files, exit codes, the stack
signal), the ledger file and the job identity (``records.jobid``). The names below load
on first use, so importing ``torchvitals.supervisor.options`` (the CLI's flags) loads none of
the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_EXPORTS = {"Supervisor": ".supervisor", "SupervisorConfig": ".options", "supervise": ".command"}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # `import X as X`: re-exported for type checkers (PEP 484)
    from .command import supervise as supervise
    from .options import SupervisorConfig as SupervisorConfig
    from .supervisor import Supervisor as Supervisor

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
