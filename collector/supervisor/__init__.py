"""``torchvitals supervise``: run a training launcher, restart it when it crashes or hangs.

``supervisor`` is the restart policy (attempts, hang clock, back-off, exit codes), ``process``
stops a job's processes from outside, ``config`` its settings, ``metrics`` its /metrics. It
talks to the job only through ``torchvitals.protocol`` (heartbeat files, exit codes) and the
ledger file; it imports no torch.
"""

from .config import SupervisorConfig
from .supervisor import Supervisor, supervise

__all__ = ["Supervisor", "SupervisorConfig", "supervise"]
