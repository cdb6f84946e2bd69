"""botocore's exceptions and answers as datamover's typed errors (naming bucket, key and HTTP status), and the facts
the backend reads off a failed call (its S3 error code, its retries, a refused checksum)."""

from __future__ import annotations

import binascii
import errno as errno_mod

from ...errors import ChecksumMismatch, DatamoverError, ObjectStoreError

_ERRNO = {403: errno_mod.EACCES, 404: errno_mod.ENOENT, 416: errno_mod.EINVAL}


def refuses_checksum(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    code = response.get("Error", {}).get("Code", "")
    message = response.get("Error", {}).get("Message", "").lower()
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status in (400, 501) and (code in ("NotImplemented", "InvalidArgument") or "checksum" in message)


def object_store_error(
    exc: BaseException, bucket: str, key: str, what: str, *, index: int | None = None, backend: str = "s3"
) -> DatamoverError:
    """Map a boto3/botocore exception to a typed error naming the bucket, the key and the HTTP status."""
    if isinstance(exc, DatamoverError):
        return exc
    import botocore.exceptions as bx

    where = f"{what} s3://{bucket}/{key}"
    # binascii.Error: the answer's checksum header is not base64 (botocore decodes it while it checks the body)
    if isinstance(exc, bx.FlexibleChecksumError | binascii.Error):
        err = ChecksumMismatch(f"{where}: {exc}", index=index, backend=backend)
        err.bucket, err.key = bucket, key
        return err
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(err.get("Code") or status)
        message = err.get("Message") or ""
        if code in ("NoSuchBucket",) or (code == "404" and what == "HEAD bucket"):
            why = f"bucket {bucket!r} does not exist"
        elif code in ("NoSuchKey", "404"):
            why = f"no object {key!r} in bucket {bucket!r}"
        elif status == 403:
            why = f"access denied ({code}: {message or 'check the credentials and the bucket policy'})"
        else:
            why = f"{code}: {message}" if message else code
        return ObjectStoreError(
            f"{where} failed: HTTP {status}, {why}",
            bucket=bucket, key=key, status=status, code=code,
            errno=_ERRNO.get(status or 0, errno_mod.EIO), index=index, backend=backend,
        )  # fmt: skip
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return ObjectStoreError(
            f"{where} failed: {exc} (set access_key_id/secret_access_key, AWS_* variables or ~/.aws/credentials)",
            bucket=bucket, key=key, code="NoCredentials", errno=errno_mod.EACCES, index=index, backend=backend,
        )  # fmt: skip
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectTimeoutError):
        return ObjectStoreError(
            f"{where} failed: endpoint unreachable ({exc})",
            bucket=bucket, key=key, code=type(exc).__name__, errno=errno_mod.ECONNREFUSED,
            index=index, backend=backend,
        )  # fmt: skip
    if isinstance(exc, bx.ConnectionError | bx.ReadTimeoutError | bx.ResponseStreamingError | OSError):
        return ObjectStoreError(
            f"{where} failed: connection lost ({type(exc).__name__}: {exc})",
            bucket=bucket, key=key, code=type(exc).__name__, errno=errno_mod.ECONNRESET,
            index=index, backend=backend,
        )  # fmt: skip
    if isinstance(exc, bx.BotoCoreError):
        return ObjectStoreError(
            f"{where} failed: {type(exc).__name__}: {exc}",
            bucket=bucket, key=key, code=type(exc).__name__, errno=errno_mod.EIO, index=index, backend=backend,
        )  # fmt: skip
    return DatamoverError(f"{where} failed: {type(exc).__name__}: {exc}", index=index, backend=backend)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError (or the one a typed error wraps), else ""."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


def retry_attempts(exc: BaseException) -> int | None:
    """How many times botocore retried the call that failed with ``exc`` (or the error it wraps); None: unknown."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            attempts = response.get("ResponseMetadata", {}).get("RetryAttempts")
            return attempts if isinstance(attempts, int) else None
    return None
