"""Entry point of the collector service.

    torchvitals-collector --port 9500 --state-dir /var/lib/torchvitals
    python -m torchvitals.collector --help

Every flag is also read from ``TORCHVITALS_COLLECTOR_<FLAG>`` (``TORCHVITALS_WEBHOOK_TOKEN_FILE``
for the token file); precedence: flag > environment > default.
Alertmanager's token comes from ``--webhook-token-file`` or ``TORCHVITALS_WEBHOOK_TOKEN``; the
jobs' own tokens from ``--job-tokens-file`` or ``TORCHVITALS_COLLECTOR_JOB_TOKENS``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .config import CollectorConfig
from .server import serve


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the configuration and serve.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    return serve(CollectorConfig.from_args(argv))


if __name__ == "__main__":
    sys.exit(main())
