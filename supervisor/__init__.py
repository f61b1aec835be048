"""``torchvitals supervise``: run a training launcher, restart it when it crashes or hangs.

``supervisor`` is the loop over attempts; ``attempt`` runs one (``process`` starts the launcher
tied to the supervisor and stops the job's processes from outside, ``hang_clock`` tells a hang
from the heartbeats) and ``outcomes`` says how it ended; ``restart_policy`` decides what comes
next. Each disruption is an incident naming its culprit: ``witness`` keeps what this node sees
of an attempt's ranks (``deaths`` when each process ended and how, ``launcher_log`` torchrun's
reports on its stderr, ``rank_probe`` their states and stacks), ``localizer`` turns a hang, a
crash or a lost node into its incident (the rules: ``localize``, on ``findings`` from every
node), and ``disruptions`` writes it with the node's goodput timeline. For a job of several
nodes, ``peers`` is what a node asks of the others and the orders they answer with,
``store_peers`` their agreement through the job's etcd (``barrier`` the start of an attempt,
``membership`` the nodes present, ``findings_exchange`` the findings about an incident,
``job_store`` and ``job_records`` the keys, ``etcd`` the store's client). ``options`` holds its
settings, ``telemetry`` its /metrics and ``command`` the CLI around it. It talks to the job only
through ``torchvitals.protocol`` (heartbeat files, exit codes, the stack signal), the ledger file
and the job identity (``agent.recover.jobid``); it imports no torch.
"""

from .command import supervise
from .options import SupervisorConfig
from .supervisor import Supervisor

__all__ = ["Supervisor", "SupervisorConfig", "supervise"]
