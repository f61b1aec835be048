"""Who a bearer token speaks for: Alertmanager (post alerts) or one job (its own directives).

    python -m pytest tests/integration/test_collector_tokens.py

Two kinds of token, each with one power, so that no job can order another one about:

- the webhook token (``TORCHVITALS_WEBHOOK_TOKEN[_FILE]``) is Alertmanager's: it may
  ``POST /alerts`` and nothing else;
- a job's token (one entry of the job tokens, a JSON object ``{"job": "token"}``, or
  ``{"job": "sha256:<hex>"}`` holding only the digest) may read and acknowledge that job's
  directives and nothing else. A job's ranks hold only their own token.

A token is looked up by its SHA-256 digest and then compared with ``hmac.compare_digest``, so
the answer's timing says nothing about the token's prefix; no token or digest is ever logged or
put in a message. A token known to nobody is a 401; a known token used beyond its power is a
403 whose reason names the job it belongs to, never the token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..protocol import TokenError

log = logging.getLogger("torchvitals.collector")

ALERTMANAGER = "alertmanager"
JOB = "job"
DIGEST_PREFIX = "sha256:"


@dataclass(frozen=True)
class Principal:
    """What a request's token speaks for."""

    kind: str
    """``ALERTMANAGER`` or ``JOB``."""
    job: str | None = None
    """The job a ``JOB`` token belongs to."""

    def describe(self) -> str:
        """Returns: words for a 403 reason ("the webhook token", "the token of job 'a'")."""
        if self.kind == ALERTMANAGER:
            return "the webhook token"
        return f"the token of job {self.job!r}"


def digest(token: str) -> bytes:
    """The SHA-256 digest of a token (what lookups and comparisons use).

    Args:
        token: the token, already stripped.

    Returns:
        32 bytes.
    """
    return hashlib.sha256(token.encode()).digest()


def parse_job_tokens(text: str, where: str) -> dict[bytes, str]:
    """Read a job tokens document.

    Args:
        text: a JSON object mapping job name -> token or ``sha256:<64 hex digits>``.
        where: the file or variable it came from, for error messages.

    Returns:
        Token digest -> job name.

    Raises:
        TokenError: it is not such an object, a token is empty or malformed, or two jobs
            share a token (the message names the jobs, never a token).
    """
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenError(f"{where}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(mapping, dict):
        raise TokenError(f"{where}: must be a JSON object mapping job name -> token")
    by_digest: dict[bytes, str] = {}
    for job, token in mapping.items():
        if not job or not isinstance(token, str) or not token.strip():
            raise TokenError(f"{where}: job {job!r} needs a non-empty token string")
        token = token.strip()
        if token.startswith(DIGEST_PREFIX):
            hexdigest = token[len(DIGEST_PREFIX) :]
            try:
                key = bytes.fromhex(hexdigest)
            except ValueError:
                key = b""
            if len(key) != 32:
                raise TokenError(f"{where}: job {job!r}: sha256: needs 64 hex digits")
        else:
            key = digest(token)
        if key in by_digest:
            raise TokenError(
                f"{where}: jobs {by_digest[key]!r} and {job!r} share a token; give each job its own"
            )
        by_digest[key] = job
    return by_digest


class Tokens:
    """The tokens the collector accepts; the job tokens file is re-read when it changes.

    Args:
        webhook_token: Alertmanager's token.
        job_tokens: the job tokens document itself (from the environment), or None.
        job_tokens_file: a file holding it (a mounted secret), or None.

    Raises:
        TokenError: the tokens cannot be read, or a job's token equals the webhook token.
    """

    def __init__(
        self, webhook_token: str, job_tokens: str | None = None, job_tokens_file: str | None = None
    ) -> None:
        self._webhook = digest(webhook_token)
        self._file = Path(job_tokens_file) if job_tokens_file else None
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._error: str | None = None
        self._jobs: dict[bytes, str] = {}
        if job_tokens is not None:
            self._jobs = self._checked(
                parse_job_tokens(job_tokens, "TORCHVITALS_COLLECTOR_JOB_TOKENS")
            )
        elif self._file is not None:
            self._reload(strict=True)
        if not self._jobs:
            log.warning(
                "no job tokens (--job-tokens-file or TORCHVITALS_COLLECTOR_JOB_TOKENS): "
                "Alertmanager can post alerts, but no job can poll its directives"
            )

    def _checked(self, jobs: dict[bytes, str]) -> dict[bytes, str]:
        if self._webhook in jobs:
            raise TokenError(
                f"job {jobs[self._webhook]!r} has the webhook token as its token: "
                "a job holding Alertmanager's token could order any job; give "
                "it its own"
            )
        return jobs

    def _reload(self, strict: bool) -> None:
        """Re-read the file when its mtime or size changed; a bad edit keeps the old tokens
        (logged once per bad version of the file, not once per request)."""
        assert self._file is not None
        try:
            st = os.stat(self._file)
        except OSError as exc:
            stamp, error = (
                None,
                TokenError(f"{self._file}: cannot read the job tokens: {exc.strerror or exc}"),
            )
        else:
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            try:
                jobs = self._checked(
                    parse_job_tokens(self._file.read_text(encoding="utf-8"), str(self._file))
                )
            except OSError as exc:
                error = TokenError(
                    f"{self._file}: cannot read the job tokens: {exc.strerror or exc}"
                )
            except TokenError as exc:
                error = exc
            else:
                self._jobs, self._stamp, self._error = jobs, stamp, None
                if not strict:
                    log.info("job tokens re-read from %s: %d job(s)", self._file, len(jobs))
                return
        if strict:
            raise error
        self._stamp = stamp
        if str(error) != self._error:
            self._error = str(error)
            log.error("%s; keeping the %d job token(s) read before", error, len(self._jobs))

    def jobs(self) -> int:
        """Returns: the number of jobs holding a token."""
        return len(self._jobs)

    def identify(self, authorization: str | None) -> Principal | None:
        """Who an ``Authorization`` header speaks for.

        Args:
            authorization: the header's value, or None.

        Returns:
            The principal, or None for a missing, malformed or unknown token (a 401).
        """
        scheme, _, given = (authorization or "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return None
        key = digest(given)
        if hmac.compare_digest(key, self._webhook):
            return Principal(ALERTMANAGER)
        if self._file is not None:
            with self._lock:
                self._reload(strict=False)
        # Found by digest: what a lookup's timing could leak is a digest's prefix, not the token's.
        job = self._jobs.get(key)
        return None if job is None else Principal(JOB, job)
