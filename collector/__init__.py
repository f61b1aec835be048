"""The job-level collector: Alertmanager webhook in, directives for the job out.

    torchvitals-collector --help

``webhook`` parses and validates the payload, ``directives`` keeps the directives it yields
(idempotent, on disk), ``server`` serves them over HTTP, ``metrics`` counts what happened; ``supervisor`` restarts a
job that crashes or hangs (``torchvitals supervise -- CMD``).
"""

from .config import CollectorConfig, SupervisorConfig
from .directives import Directive, DirectiveStore
from .server import CollectorServer, create_app, serve
from .supervisor import Supervisor, supervise
from .webhook import Notification, PayloadError, parse_notification

__all__ = ["CollectorConfig", "CollectorServer", "Directive", "DirectiveStore", "Notification",
           "PayloadError", "Supervisor", "SupervisorConfig", "create_app", "parse_notification",
           "serve", "supervise"]
