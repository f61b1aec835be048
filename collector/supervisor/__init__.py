"""``torchvitals supervise``: run a training launcher, restart it when it crashes or hangs.

``supervisor`` is the restart policy (attempts, hang clock, back-off, exit codes), ``process``
starts a job's launcher tied to it and stops the job's processes from outside, ``peers`` the
agreement of the supervisors of a job's nodes and ``etcd`` the store they agree through,
``config`` its settings, ``metrics`` its /metrics. It talks to the job only through
``torchvitals.protocol`` (heartbeat files, exit codes), the ledger file and the job identity
(``agent.recover.jobid``); it imports no torch.
"""

from .config import SupervisorConfig
from .supervisor import Supervisor, supervise

__all__ = ["Supervisor", "SupervisorConfig", "supervise"]
