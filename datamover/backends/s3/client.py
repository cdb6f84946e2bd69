"""The backend's boto3 clients: made from its parameters (falling back on the AWS environment and config files), with
botocore's retries bounded by the transfer's deadline; bounded clients for calls made outside transfers."""

from __future__ import annotations

import os
from typing import Any

from ...errors import InvalidParameter
from .retries import RETRY_MODES, bound_retries

#: the bound on each call that settles a cut-short upload (release() waits up to 10 s past the deadline for it)
_SETTLE_S = 3.0


class S3Clients:
    """The S3 backend's boto3 clients: the one its transfers use, and bounded ones (settling uploads, callers' own)."""

    def _make_client(self, **overrides: Any) -> Any:
        import boto3
        import botocore.exceptions
        import botocore.session
        from botocore.config import Config

        p = {**self.params, **overrides}
        try:
            session = boto3.session.Session(
                aws_access_key_id=p["access_key_id"],
                aws_secret_access_key=p["secret_access_key"],
                aws_session_token=p["session_token"],
                region_name=p["region"],
                profile_name=p["profile"],
                botocore_session=botocore.session.Session(),
            )
            scoped = session._session.get_scoped_config()
        except botocore.exceptions.BotoCoreError as exc:
            raise InvalidParameter(f"{exc}", backend="s3") from exc
        mode = p["retry_mode"] or os.environ.get("AWS_RETRY_MODE") or scoped.get("retry_mode") or "standard"
        if mode not in RETRY_MODES:  # ours, the environment's or a profile's
            raise InvalidParameter(f"retry_mode must be one of {', '.join(RETRY_MODES)}, got {mode!r}", backend="s3")
        given = p["max_attempts"] or os.environ.get("AWS_MAX_ATTEMPTS") or scoped.get("max_attempts") or 5
        try:
            attempts = int(given)
        except (TypeError, ValueError):
            attempts = 0
        if attempts < 1:
            raise InvalidParameter(f"max_attempts must be an integer >= 1, got {given!r}", backend="s3")
        retries = {"mode": mode, "total_max_attempts": attempts}
        if not overrides:
            self.retries = retries
        config = Config(
            retries=retries,
            max_pool_connections=int(p["concurrency"]),
            connect_timeout=float(p["connect_timeout"]),
            read_timeout=float(p["read_timeout"]),
            s3={"addressing_style": p["addressing_style"]},
            # we compute CRC32C ourselves (once, GIL-free) and verify reads against our metadata
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            client = session.client(
                "s3",
                endpoint_url=p["endpoint_url"],
                region_name=session.region_name or "us-east-1",
                verify=p["verify_tls"],
                config=config,
            )
        except (ValueError, botocore.exceptions.BotoCoreError) as exc:  # a region or endpoint from the environment
            raise InvalidParameter(f"cannot make an S3 client: {exc}", backend="s3") from exc
        bound_retries(client, mode, attempts, session._session, self._botocore_may_retry, self._stopped_transfer)
        return client

    def settle_client(self) -> Any:
        """The client that settles a cut-short upload (HEAD, abort): each call ends within about ``_SETTLE_S``."""
        with self._settler_lock:
            if self._settler is None:
                self._settler = self.bounded_client(_SETTLE_S)
            return self._settler

    @property
    def client(self) -> Any:
        """The boto3 S3 client this backend uses (thread-safe, shared by the pool)."""
        return self._client

    def bounded_client(self, timeout_s: float, max_attempts: int = 2) -> Any:
        """A client on the same store and credentials whose every call ends within about `timeout_s` (for calls
        made outside transfers, which have no deadline of their own: `max_attempts` tries of connect + read)."""
        per_try = timeout_s / max(1, max_attempts)
        return self._make_client(
            connect_timeout=min(float(self.params["connect_timeout"]), per_try / 2),
            read_timeout=min(float(self.params["read_timeout"]), per_try / 2),
            max_attempts=max_attempts,
        )
