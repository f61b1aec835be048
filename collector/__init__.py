"""The job-level collector: Alertmanager webhook in, directives for the job out; and the supervisor.

    torchvitals-collector --help

``webhook`` parses and validates the payload, ``directives`` keeps the directives it yields
(idempotent, on disk), ``server`` serves them over HTTP, ``metrics`` counts what happened,
``config`` its settings. ``supervisor/`` restarts a job that crashes or hangs
(``torchvitals supervise -- CMD``). Imports no torch: the collector image carries none.
"""

from .config import CollectorConfig
from .directives import Directive, DirectiveStore
from .server import CollectorServer, create_app, serve
from .supervisor import Supervisor, SupervisorConfig, supervise
from .webhook import Notification, PayloadError, parse_notification

__all__ = ["CollectorConfig", "CollectorServer", "Directive", "DirectiveStore", "Notification",
           "PayloadError", "Supervisor", "SupervisorConfig", "create_app", "parse_notification",
           "serve", "supervise"]
