"""TLS settings of a rank's /metrics, and the SSL context they make.

    ctx = TLS(certfile="cert.pem", keyfile="key.pem", client_cafile="ca.pem").context()

Kept apart from the server (``server.py``) so the settings and their errors, which name the
``metrics_*`` fields, read on their own.
"""

from __future__ import annotations

import dataclasses
import ssl


@dataclasses.dataclass(frozen=True)
class TLS:
    """TLS for /metrics, as prometheus-client's own server takes it.

    Args:
        certfile, keyfile: the server's certificate chain and key (PEM).
        client_cafile: a CA bundle; with it, clients may present a certificate it signed.
        client_auth_required: refuse clients without such a certificate (mutual TLS).
    """

    certfile: str
    keyfile: str | None = None
    client_cafile: str | None = None
    client_auth_required: bool = False

    def context(self) -> ssl.SSLContext:
        """The server's SSL context.

        Raises:
            ValueError: a file cannot be read or is not what its setting says, naming both.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"metrics_certfile {self.certfile!r} / metrics_keyfile "
                f"{self.keyfile!r}: not a readable PEM certificate chain and its "
                f"key ({exc})"
            ) from None
        if self.client_cafile:
            try:
                ctx.load_verify_locations(cafile=self.client_cafile)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"metrics_client_cafile {self.client_cafile!r}: not a readable "
                    f"PEM CA bundle ({exc})"
                ) from None
            ctx.verify_mode = ssl.CERT_REQUIRED if self.client_auth_required else ssl.CERT_OPTIONAL
        elif self.client_auth_required:
            raise ValueError(
                "metrics_client_auth_required needs metrics_client_cafile: the CA "
                "whose client certificates are accepted"
            )
        return ctx
