"""The one base of every error torchvitals raises on purpose.

    try:
        agent = torchvitals.watch(model, optimizer, checkpoint_dir="ckpt")
    except torchvitals.TorchvitalsError as exc:     # a refused checkpoint, a taken port, ...
        ...

Each error also keeps the built-in base it always had (``OSError`` for a port that cannot be
bound, ``ValueError`` for a malformed webhook, ``SystemExit`` for the abort), so code written
against those keeps working. Torch-free: the collector and the supervisor raise these too.
"""

from __future__ import annotations


class TorchvitalsError(Exception):
    """Base class of the errors torchvitals raises on purpose (``except TorchvitalsError``)."""
