"""The job-level collector: Alertmanager webhook in, directives for the job out.

    torchvitals-collector --help

``webhook`` parses and validates the payload, ``directives`` keeps the directives it yields
(idempotent, on disk, bounded, bound to the run they are for), ``auth`` says which token may do
what (Alertmanager's posts alerts, a job's serves its own directives), ``server`` serves them
over HTTP, ``metrics`` counts what happened, ``config`` its settings. Imports no torch: the
collector image carries none. (The per-node supervisor, ``torchvitals supervise``, is a package
of its own: ``torchvitals.supervisor``.)
"""

from .auth import Principal, Tokens
from .config import CollectorConfig
from .directives import Directive, DirectiveStore, StoreFull, StoreLimits
from .server import CollectorServer, create_app, serve
from .webhook import Notification, PayloadError, parse_notification

__all__ = [
    "CollectorConfig",
    "CollectorServer",
    "Directive",
    "DirectiveStore",
    "Notification",
    "PayloadError",
    "Principal",
    "StoreFull",
    "StoreLimits",
    "Tokens",
    "create_app",
    "parse_notification",
    "serve",
]
