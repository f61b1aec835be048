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


class ConfigError(TorchvitalsError, ValueError):
    """A setting's value is not one it can take.

    The message names the setting, the value, what is allowed and, once known, where the value
    came from (an argument or a ``TORCHVITALS_*`` variable).
    """

    def __init__(self, field: str, value: object, allowed: str, source: str | None = None) -> None:
        self.field, self.value, self.allowed, self.source = field, value, allowed, source
        where = f" (from {source})" if source else ""
        super().__init__(f"{field}={value!r}{where}: {allowed}")

    def from_source(self, source: str) -> ConfigError:
        """The same error, saying where the value came from."""
        return type(self)(self.field, self.value, self.allowed, source)


class ConfigTypeError(ConfigError, TypeError):
    """A setting's value is of the wrong type (also a TypeError)."""
