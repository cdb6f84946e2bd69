"""s3: DRAM <-> OBJ with boto3, against AWS S3 or any S3-compatible endpoint (MinIO, Ceph RGW, moto).

Semantics of an OBJ descriptor (offset, length) naming key k of a registered bucket:

- WRITE (offset 0, length n) stores the whole object k as n bytes: one PUT, or
  a multipart upload with parallel parts above ``multipart_threshold``. S3 has
  no partial overwrite, so a non-zero offset on WRITE is refused when the
  transfer is made, and so are two WRITE rows naming the same object. A failed
  multipart upload is aborted: the object is either all new bytes or untouched.
  A CompleteMultipartUpload that got no answer is resolved (the upload's
  marker in the visible object's metadata means committed; else it is
  aborted), and a WRITE that failed, timed out or was cut short by
  ``release()`` carries ``outcomes`` on its error (``Transfer.outcomes``):
  caller descriptor index -> "committed" (the object holds the new bytes),
  "aborted" (started, then aborted or refused: the object is as it was),
  "untouched" (never started) or "unknown" (no answer and the server could
  not be asked), for every descriptor of the WRITE; from ERR on, rows still
  in flight are "unknown" until settled. botocore retries nothing for a
  transfer cancelled or past its deadline, nor one whose backoff would end
  past it (every retry mode: legacy, standard, adaptive).
  A CreateMultipartUpload is retried by us: one whose answer was lost may
  have started an upload, which is found (the key's uploads started since)
  and aborted.
- READ (offset, length) is a ranged GET; above ``read_part_size`` it is split
  into parallel ranged GETs into the destination. A READ at offset 0 of the
  whole row is a plain GET: when the object is exactly that long it is a
  whole-object read and is verified; when longer, its first bytes are kept.
  A read that runs past the object's end fails the descriptor. A zero-length
  READ makes no request.

Integrity: every write carries the CRC32C of the whole object in metadata
(``x-amz-meta-crc32c``, base64 of the big-endian value, like S3's own header)
and, where the server takes it, S3's ``x-amz-checksum-crc32c`` so the server
checks the upload. Metadata is what reads check first, because S3 returns its
own checksums neither on ranged GETs nor as a whole-object value for multipart
uploads; objects written by other tools are verified with S3's whole-object
CRC32C (by us) or CRC32/SHA (by botocore). A mismatch fails the descriptor with
ChecksumMismatch and its destination never keeps the bytes: up to 1 MiB they
are checked before the copy, larger ones land and are zeroed on mismatch, and
a row read in parts that fails is zeroed (its parts were never checked whole).

Work runs on a bounded pool of ``concurrency`` threads pulling objects and
parts from one shared list, so 4096 small objects cost ``concurrency``
executor submits, not 4096. Configuration falls back to the usual AWS
environment variables and config files for anything not set here.
"""

from __future__ import annotations

import base64
import binascii
import errno as errno_mod
import importlib.util
import itertools
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import numpy as np

from ...descriptors import MemType
from ...errors import (
    ChecksumMismatch,
    DatamoverError,
    InvalidParameter,
    ObjectStoreError,
    OverlappingDestination,
)
from ...units import MiB
from ..base import Backend, BackendHost, Completion, TransferRequest, clock, refuse_offset_writes, typed_error
from ..fence import ReadFence

log = logging.getLogger("datamover.s3")

#: metadata key holding the whole object's CRC32C (base64 of the big-endian 4 bytes)
CRC_META = "crc32c"
#: metadata key marking a multipart upload, so that an unanswered CompleteMultipartUpload can be resolved
UPLOAD_META = "dm-upload"
_MIN_PART = 5 * MiB  # S3's smallest non-final multipart part
_MAX_PARTS = 10_000

#: whole objects up to this size are verified before they touch the destination; larger ones land, then are checked
_VERIFY_BEFORE_COPY = 1 * MiB
_READ_CHUNK = 1 * MiB
#: the bound on each call that settles a cut-short upload (release() waits up to 10 s past the deadline for it)
_SETTLE_S = 3.0
#: HTTP statuses of a CreateMultipartUpload worth another try (throttled, server busy or failing)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
#: how much earlier than our clock says the store may have stamped an upload we started
_CLOCK_SLACK_S = 2.0
#: S3 checksums botocore verifies itself while a body is read to its end (CRC32C needs awscrt there: we do it)
_BOTOCORE_CHECKED = ("ChecksumCRC32", "ChecksumSHA1", "ChecksumSHA256")
#: botocore's retry modes (each is bounded by the transfer's deadline: _bound_retries)
_RETRY_MODES = ("legacy", "standard", "adaptive")
#: how often a retry's backoff looks whether its transfer was cancelled meanwhile
_BACKOFF_POLL_S = 0.05
#: what botocore accepts as a region name
_REGION = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_ERRNO = {403: errno_mod.EACCES, 404: errno_mod.ENOENT, 416: errno_mod.EINVAL}

_T = TypeVar("_T")


def crc32c_b64(data: Any) -> str:
    """CRC32C of ``data`` as S3 writes it: base64 of the 4 big-endian bytes."""
    import crc32c

    return _b64(crc32c.crc32c(data))


def _b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


@dataclass
class _Group:
    """A row moved as several tasks (multipart upload parts or split ranged reads)."""

    row: int
    nparts: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    left: int = 0
    upload_id: str | None = None
    etags: list = field(default_factory=list)
    failed: bool = False
    finished: bool = False
    meta_crc: str | None = None
    total: int | None = None
    marker: str = ""  # in the upload's metadata: tells whether the visible object is this upload's


@dataclass(eq=False)
class S3Plan:
    """One request's objects per row (bucket, key, offset, length, where in memory) and its ``tasks``: (row, part
    index or -1 for a whole-row task, byte start within the row, byte count); ``groups`` parts per split row."""

    bucket: list[str]
    key: list[str]
    off: list[int]
    len: list[int]
    mem_reg: list[int]
    mem_off: list[int]
    arrays: dict[int, np.ndarray]
    tasks: list[tuple[int, int, int, int]] = field(default_factory=list)
    groups: dict[int, int] = field(default_factory=dict)


class S3Backend(Backend):
    """Host memory to and from objects of registered buckets, through boto3 on a bounded pool."""

    name = "s3"
    pairs = frozenset({(MemType.DRAM, MemType.OBJ)})
    default_params = {
        # where and who: None falls back to AWS_* environment variables and ~/.aws/{config,credentials}
        "endpoint_url": None,
        "region": None,
        "profile": None,
        "access_key_id": None,
        "secret_access_key": None,
        "session_token": None,
        "addressing_style": "auto",  # "path", "virtual" or "auto"
        "verify_tls": True,  # or a CA bundle path
        # how fast
        "concurrency": 16,
        "multipart_threshold": 16 * MiB,  # objects larger than this go as multipart uploads
        "part_size": 8 * MiB,
        "read_part_size": 8 * MiB,  # reads longer than this are split into parallel ranged GETs
        # how hard to try
        # botocore's "legacy", "standard" or "adaptive", and attempts in all; None: AWS_RETRY_MODE,
        # AWS_MAX_ATTEMPTS or the profile's retry_mode / max_attempts, else standard with 5 attempts
        "retry_mode": None,
        "max_attempts": None,
        "connect_timeout": 5.0,
        "read_timeout": 60.0,
        # integrity
        "native_checksum": "auto",  # send x-amz-checksum-crc32c: True, False, or "auto" (drop it if refused)
        "require_checksum": True,  # a whole-object read of an object without our CRC32C fails
    }
    loose_params = frozenset({"verify_tls"})  # True, False or a CA bundle path

    def __init__(self, host: BackendHost, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(host, params)
        p = self.params
        if int(p["part_size"]) < _MIN_PART:
            raise InvalidParameter(
                f"part_size must be >= 5 MiB (S3's minimum part), got {p['part_size']}", backend="s3"
            )
        if int(p["multipart_threshold"]) < int(p["part_size"]):
            raise InvalidParameter("multipart_threshold must be >= part_size", backend="s3")
        if p["addressing_style"] not in ("auto", "path", "virtual"):
            style = p["addressing_style"]
            raise InvalidParameter(f"addressing_style must be auto, path or virtual, got {style!r}", backend="s3")
        if p["native_checksum"] not in (True, False, "auto"):
            native = p["native_checksum"]
            raise InvalidParameter(f"native_checksum must be True, False or 'auto', got {native!r}", backend="s3")
        _check_params(p)
        self._native = p["native_checksum"]
        self._stage = threading.local()
        # .stop: whether the transfer of this thread's call may no longer retry; .deadline: that transfer's (clock())
        self._calling = threading.local()
        self._settler: Any = None
        self._settler_lock = threading.Lock()
        self._client = self._make_client()
        self._pool = ThreadPoolExecutor(int(p["concurrency"]), thread_name_prefix="dm-s3")

    @classmethod
    def available(cls) -> tuple[bool, str]:
        missing = [m for m in ("boto3", "botocore", "crc32c") if importlib.util.find_spec(m) is None]
        if missing:
            return False, f"needs {', '.join(missing)} (pip install 'datamover[s3]')"
        return True, "ok"

    @classmethod
    def environment(cls) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        here: dict[str, Any] = {}
        for pkg in ("boto3", "botocore", "crc32c", "awscrt"):
            try:
                here[pkg] = version(pkg)
            except PackageNotFoundError:
                here[pkg] = "not installed"
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION"):
            if os.environ.get(var):
                here[var] = os.environ[var]
        return here

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
        if mode not in _RETRY_MODES:  # the environment's or a profile's: _check_params saw only ours
            raise InvalidParameter(f"retry_mode must be one of {', '.join(_RETRY_MODES)}, got {mode!r}", backend="s3")
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
        _bound_retries(client, mode, attempts, session._session, self._botocore_may_retry, self._stopped_transfer)
        return client

    def _botocore_may_retry(self, delay: float) -> bool:
        """Whether botocore may retry this thread's call after waiting ``delay`` s (waited here): not a call we
        retry ourselves (``_Run.create_upload``), else as ``_wait_to_retry``."""
        return not getattr(self._calling, "once", False) and self._wait_to_retry(delay)

    def _wait_to_retry(self, delay: float) -> bool:
        """Wait ``delay`` s before a retry of this thread's call; False, without waiting it out, where its transfer
        was cancelled (before or meanwhile) or the retry would start past its deadline: a retry sent then could commit
        an object after the transfer ended ERR and ``release()`` returned."""
        if self._stopped_transfer():
            return False
        deadline = getattr(self._calling, "deadline", None)
        end = clock() + delay
        if deadline is not None and end >= deadline:
            return False
        while (left := end - clock()) > 0:
            time.sleep(min(left, _BACKOFF_POLL_S))
            if self._stopped_transfer():
                return False
        return True

    def _stopped_transfer(self) -> bool:
        """Whether the transfer this thread calls for was cancelled or is past its deadline."""
        stop = getattr(self._calling, "stop", None)
        return stop is not None and stop()

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

    def describe(self) -> dict[str, Any]:
        p = self.params
        return {
            "endpoint": self._client.meta.endpoint_url,
            "region": self._client.meta.region_name,
            "concurrency": p["concurrency"],
            "part_size": p["part_size"],
            "multipart_threshold": p["multipart_threshold"],
            "retries": f"{self.retries['mode']}, {self.retries['total_max_attempts']} attempts",
        }

    # -- planning ------------------------------------------------------------
    def plan(self, req: TransferRequest) -> S3Plan:
        mem, obj = req.local, req.remote
        n = len(obj)
        write = req.op == "WRITE"
        refuse_offset_writes(req, lambda row: obj.keys[int(obj.dev[row])], "S3", self.name)
        regs = req.registrations
        obj_regs, obj_inv = np.unique(req.remote_regions, return_inverse=True)
        buckets = np.array([regs[r].extra["bucket"] for r in obj_regs.tolist()], dtype=object)[obj_inv.reshape(-1)]
        keys = np.asarray(obj.keys, dtype=object)[obj.dev] if n else np.zeros(0, dtype=object)
        if write and n > 1:
            self._refuse_same_object(req, buckets, keys)
        mem_regs, mem_inv = np.unique(req.local_regions, return_inverse=True)
        bases = np.array([regs[r].addr for r in mem_regs.tolist()], dtype=np.int64)
        p = S3Plan(
            bucket=buckets.tolist(),
            key=keys.tolist(),
            off=obj.addr.tolist(),
            len=obj.length.tolist(),
            mem_reg=req.local_regions.tolist(),
            mem_off=(mem.addr - bases[mem_inv.reshape(-1)]).tolist(),
            arrays={r: regs[r].array for r in mem_regs.tolist()},
        )
        # tasks: (row, part index or -1 for a whole-row task, byte start within the row, byte count)
        ln = obj.length
        split_at = int(self.params["multipart_threshold"] if write else self.params["read_part_size"])
        big = ln > split_at
        if write:
            keep = np.ones(n, dtype=bool)  # zero-length writes still create (empty) objects
        else:
            keep = ln > 0
        big_rows = np.flatnonzero(big)
        if write:  # S3 allows 10,000 parts: huge objects get bigger parts
            part = np.maximum(int(self.params["part_size"]), -(-ln[big_rows] // _MAX_PARTS))
        else:
            part = np.full(big_rows.shape[0], int(self.params["read_part_size"]), dtype=np.int64)
        counts = -(-ln[big_rows] // np.maximum(part, 1))
        # big rows' parts first, so the long poles start early; then whole-row tasks
        g_rows = np.repeat(big_rows, counts)
        g_part = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        g_start = g_part * np.repeat(part, counts)
        g_count = np.minimum(np.repeat(part, counts), ln[g_rows] - g_start)
        small_rows = np.flatnonzero(keep & ~big)
        rows = np.concatenate([g_rows, small_rows])
        parts = np.concatenate([g_part, np.full(small_rows.shape[0], -1, dtype=np.int64)])
        starts = np.concatenate([g_start, np.zeros(small_rows.shape[0], dtype=np.int64)])
        nbytes = np.concatenate([g_count, ln[small_rows]])
        p.tasks = list(zip(rows.tolist(), parts.tolist(), starts.tolist(), nbytes.tolist()))
        p.groups = dict(zip(big_rows.tolist(), counts.tolist()))
        return p

    def _refuse_same_object(self, req: TransferRequest, buckets: np.ndarray, keys: np.ndarray) -> None:
        """Two WRITE rows naming one object (a key repeated in the key table) would race: refuse them."""
        names = keys.astype(str)
        if np.unique(names).shape[0] == names.shape[0]:
            return
        pairs = np.char.add(np.char.add(buckets.astype(str), "/"), names)
        _, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
        seen = first[inverse.reshape(-1)]
        dup = seen != np.arange(names.shape[0])
        if dup.any():
            row = int(np.flatnonzero(dup)[0])
            raise OverlappingDestination(
                f"writes object s3://{pairs[row]} that descriptor {req.caller_index(int(seen[row]))} writes too",
                index=req.caller_index(row),
                backend=self.name,
            )

    # -- execution -----------------------------------------------------------
    def post(self, req: TransferRequest) -> Completion:
        p = req.plan
        tasks = p.tasks
        runners = min(int(self.params["concurrency"]), len(tasks))
        # a READ's runners write into the caller's memory only inside the fence (each chunk of a GET body, copied from
        # the runner's own buffer; zeroing what was not verified); a WRITE's read it only to copy a body out
        # (``_Run.copy``), inside the fence: none is touched after ERR or release()
        completion = ReadFence(runners)
        if not runners:
            return completion
        run = _Run(req, self, completion, runners)
        # one submit here; the first runner starts the others, so post() never waits on busy workers for the GIL
        self._pool.submit(run.start, self._pool)
        return completion

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in (self._client, self._settler):
            try:
                if client is not None:
                    client.close()
            except Exception as exc:  # closing must not fail the agent's close
                log.debug("closing an S3 client failed: %s", exc)

    # -- single requests -----------------------------------------------------
    def _use_native(self) -> bool:
        return self._native is True or self._native == "auto"

    def _call(self, fn, *, req: TransferRequest, row: int, what: str, at: int = 0, **kw) -> Any:
        """One boto3 call; refusals of the native checksum in "auto" mode retry without it once."""
        try:
            return fn(**kw)
        except Exception as exc:
            if self._native == "auto" and "ChecksumAlgorithm" in kw and _refuses_checksum(exc):
                log.warning("the S3 endpoint refused x-amz-checksum-crc32c; storing CRC32C in metadata only")
                self._native = False
                for k in ("ChecksumAlgorithm", "ChecksumCRC32C"):
                    kw.pop(k, None)
                try:
                    return fn(**kw)
                except Exception as exc2:
                    raise self.error(exc2, req, row, what, at) from exc2
            raise self.error(exc, req, row, what, at) from exc

    def error(self, exc: BaseException, req: TransferRequest, row: int, what: str, at: int = 0) -> DatamoverError:
        """A typed error for a failed boto3 call on ``row`` (at its byte ``at``): names the key, bucket, HTTP status."""
        p = req.plan
        bucket, key = p.bucket[row], p.key[row]
        return object_store_error(exc, bucket, key, what, index=req.caller_index(row, at), backend=self.name)

    def put(self, req: TransferRequest, row: int, body: bytes, crc: str) -> None:
        p = req.plan
        kw: dict[str, Any] = {"Bucket": p.bucket[row], "Key": p.key[row], "Body": body}
        kw["Metadata"] = {CRC_META: crc}
        if self._use_native():
            kw["ChecksumAlgorithm"] = "CRC32C"
            kw["ChecksumCRC32C"] = crc
        self._call(self._client.put_object, req=req, row=row, what="PUT", **kw)

    def get(self, req: TransferRequest, row: int, start: int, count: int, dst: np.ndarray, fence: ReadFence) -> dict:
        """GET ``count`` bytes at ``start`` of row's range into ``dst``; returns the response facts we need.

        A whole row at object offset 0 is asked for without a Range: when the
        object is exactly that long (the usual case) S3 then sends its own
        checksums too, and the read is verified. A longer object makes it a
        prefix read: ``count`` bytes are kept and the connection is dropped.
        A ranged answer must be a 206 for exactly the range asked. An answer
        without Content-Length (chunked) is read to ``count`` bytes and at most
        one more, which tells a whole object from a longer one.
        Bodies come into this thread's own buffer and are copied into ``dst`` inside ``fence``: once the transfer
        is cancelled no more of the body reaches ``dst``, and a socket never holds the caller's memory.
        """
        p = req.plan
        off = p.off[row] + start
        bucket, key = p.bucket[row], p.key[row]
        ranged = not (off == 0 and count == p.len[row])
        kw: dict[str, Any] = {"Range": f"bytes={off}-{off + count - 1}"} if ranged else {"ChecksumMode": "ENABLED"}
        resp = self._call(self._client.get_object, req=req, row=row, what="GET", at=start, Bucket=bucket, Key=key, **kw)
        body = resp["Body"]
        length = resp.get("ContentLength")  # None: a chunked answer, whose length shows only at its end
        meta = (resp.get("Metadata") or {}).get(CRC_META)
        total = length
        got = [0]
        stage = self._staging()
        try:
            if ranged:
                total = self._check_range(req, row, start, count, resp)
                _read_into(body, dst, stage, fence, got=got)  # a range: nothing to verify it against
                if length is None and not _at_end(body):
                    why = f"sent more than the range of {count}"
                    raise self._bad_answer(req, row, start, resp, "RangeIgnored", why)
            elif length is not None and length < count:
                why = f"holds {length} bytes: [0, {count}) reads past its end"
                raise self._bad_answer(req, row, start + length, resp, "ShortRead", why)
            elif length is not None and length > count:
                _read_into(body, dst, stage, fence, got=got)  # a prefix: nothing to verify it against
            elif count <= _VERIFY_BEFORE_COPY:
                # to EOF: botocore checks the length (and S3's CRC32/SHA if the object has one)
                data = body.read() if length is not None else body.read(count + 1)
                if len(data) < count:
                    raise self._bad_answer(
                        req, row, start + len(data), resp, "ShortRead",
                        f"holds {len(data)} bytes: [0, {count}) reads past its end",
                    )  # fmt: skip
                if len(data) == count:
                    if length is None:
                        body.read(1)  # the end of a chunked body: botocore checks S3's checksum there
                    self._verify(req, row, data, resp, meta)
                else:
                    total, data = None, data[:count]  # a chunked answer of a longer object: a prefix read
                _land(fence, memoryview(dst).cast("B"), 0, data)
            else:
                try:
                    # CRC32C of each chunk while the next arrives
                    crc = _read_into(body, dst, stage, fence, crc=True, got=got, ended=length is None)
                    if length is not None:
                        body.read()
                    elif not _at_end(body):
                        total, crc = None, None  # a chunked answer of a longer object: a prefix read
                    if crc is not None:
                        self._verify(req, row, crc, resp, meta)
                except Exception:
                    _zero(fence, dst)  # never leave unverified bytes behind
                    raise
        except DatamoverError:
            raise
        except _Ended:
            raise self._bad_answer(
                req, row, start + got[0], resp, "ShortRead", f"holds {got[0]} bytes: [0, {count}) reads past its end"
            ) from None
        except Exception as exc:
            raise self.error(exc, req, row, "GET", start + got[0]) from exc
        finally:
            body.close()
        return {"etag": resp.get("ETag"), "crc": meta, "total": total}

    def _staging(self) -> memoryview:
        """This pool thread's own buffer for GET bodies (one chunk, made once per thread)."""
        stage = getattr(self._stage, "buf", None)
        if stage is None:
            stage = self._stage.buf = memoryview(np.empty(_READ_CHUNK, dtype=np.uint8)).cast("B")
        return stage

    def _check_range(self, req: TransferRequest, row: int, start: int, count: int, resp: dict) -> int:
        """The object's size, from the Content-Range of a 206 for exactly [off, off + count) (or for its part up to
        the object's end: a ShortRead); any other answer is RangeIgnored."""
        off = req.plan.off[row] + start
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        m = _CONTENT_RANGE.fullmatch((resp.get("ContentRange") or "").strip())
        first, last = (int(m[1]), int(m[2])) if m else (-1, -1)
        total = int(m[3]) if m and m[3] != "*" else None
        length = resp.get("ContentLength")
        if status != 206 or first != off or last < first or (length is not None and length != last - first + 1):
            cr = resp.get("ContentRange")
            why = f"answered HTTP {status} (Content-Range {cr!r}) for bytes {off}-{off + count - 1}"
            raise self._bad_answer(req, row, start, resp, "RangeIgnored", why + " (does the server ignore Range?)")
        if last > off + count - 1 or (last < off + count - 1 and (total is None or last != total - 1)):
            raise self._bad_answer(req, row, start, resp, "RangeIgnored", f"answered bytes {first}-{last} for {count}")
        if last < off + count - 1:
            why = f"holds {total} bytes: [{off}, {off + count}) reads past its end"
            raise self._bad_answer(req, row, start + last + 1 - off, resp, "ShortRead", why)
        return total if total is not None else off + count

    def _bad_answer(self, req: TransferRequest, row: int, at: int, resp: dict, code: str, why: str) -> ObjectStoreError:
        """A GET answered with the wrong bytes (``code`` ShortRead or RangeIgnored), naming the descriptor at ``at``."""
        p = req.plan
        bucket, key = p.bucket[row], p.key[row]
        return ObjectStoreError(
            f"GET s3://{bucket}/{key} {why}",
            bucket=bucket, key=key, status=resp.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            code=code, errno=errno_mod.EIO, index=req.caller_index(row, at), backend=self.name,
        )  # fmt: skip

    def _verify(self, req: TransferRequest, row: int, data: Any, resp: dict | None, stored: str | None) -> None:
        """Check a whole object's bytes (or their CRC32C, a str): our metadata, else S3's own full-object CRC32C.

        S3's CRC32 and SHA checksums, when an object carries one instead, were
        checked by botocore while the body was read to its end.
        """
        p = req.plan
        bucket, key = p.bucket[row], p.key[row]
        native = (resp or {}).get("ChecksumCRC32C")
        if stored is None and native and "-" not in native:
            stored = native
        if stored is None:
            if resp is not None and any("-" not in str(resp.get(h, "-")) for h in _BOTOCORE_CHECKED):
                return
            if self.params["require_checksum"]:
                err = ChecksumMismatch(
                    f"s3://{bucket}/{key} carries no checksum to verify it with (no x-amz-meta-{CRC_META}, no "
                    "whole-object S3 checksum); was it written by another tool? (require_checksum=False reads it)",
                    index=req.caller_index(row),
                    backend=self.name,
                )
                err.bucket, err.key = bucket, key
                raise err
            return
        got = data if isinstance(data, str) else crc32c_b64(data)
        if got != stored:
            err = ChecksumMismatch(
                f"s3://{bucket}/{key}: CRC32C of the bytes read is {got}, the object was written with {stored}",
                index=req.caller_index(row),
                backend=self.name,
            )
            err.bucket, err.key = bucket, key
            raise err


class _Run:
    """One post of a request: runners pull tasks from a shared counter until done or cancelled."""

    def __init__(self, req: TransferRequest, backend: S3Backend, completion: ReadFence, runners: int) -> None:
        self.req = req
        self.b = backend
        self.completion = completion
        self.next = itertools.count()
        self.lock = threading.Lock()
        self.active = runners
        p = req.plan
        self.groups = {r: _Group(r, n, left=n) for r, n in p.groups.items()}
        self.write = req.op == "WRITE"
        self.outcomes: dict[int, str] = {}  # row -> "committed" | "aborted" | "unknown", for rows written
        if self.write:
            completion.drain = self.in_flight

    def in_flight(self, _seconds: float) -> None:
        """At a timeout or ``release()``: until ``cleanup`` settles them, rows started and not settled are "unknown"
        on the error (a call may still commit them), rows never started "untouched"."""
        tasks, err = self.req.plan.tasks, self.completion.error
        started = {t[0] for t in tasks[: next(self.next)]}  # taking a task index: none is started after cancel
        with self.lock:
            if err is None or getattr(err, "outcomes", None) is not None:
                return
            rows = range(len(self.req.plan.key))
            err.outcomes = {
                self.req.caller_index(r): self.outcomes.get(r, "unknown" if r in started else "untouched") for r in rows
            }

    def start(self, pool: ThreadPoolExecutor) -> None:
        """Start the other runners, then be one."""
        submitted = 0
        try:
            for _ in range(self.active - 1):
                pool.submit(self.runner)
                submitted += 1
        except RuntimeError as exc:  # the pool is shut down: account for the runners that never started
            missing = self.active - 1 - submitted
            Completion.cancel(self.completion, DatamoverError(f"the S3 backend is closed ({exc})", backend="s3"))
            with self.lock:
                self.active -= missing
            for _ in range(missing):
                self.completion.finish_part(None)
        self.runner()

    def runner(self) -> None:
        tasks = self.req.plan.tasks
        c = self.completion
        deadline = self.req.deadline
        self.b._calling.stop = lambda: c.cancelled or clock() >= deadline
        self.b._calling.deadline = deadline
        try:
            while not c.cancelled:
                i = next(self.next)
                if i >= len(tasks):
                    break
                row, part, start, count = tasks[i]
                try:
                    self.one(row, part, start, count)
                except BaseException as exc:
                    # stops the other runners; Completion's cancel, as a fence's would wait for this runner itself
                    Completion.cancel(c, typed_error(exc, "s3", self.req.caller_index(row)))
        finally:
            self.b._calling.stop = self.b._calling.deadline = None
            with self.lock:
                self.active -= 1
                last = self.active == 0
            try:
                if last:
                    self.cleanup()
            finally:
                c.finish_part(None)

    def view(self, row: int, start: int, count: int) -> np.ndarray:
        p = self.req.plan
        base = p.mem_off[row] + start
        return p.arrays[p.mem_reg[row]][base : base + count]

    def _fenced(self, read: Callable[[], _T]) -> _T:
        """`read()` of the caller's memory inside the fence; raises _Cancelled (reading nothing) once cancelled."""
        fence = self.completion
        if not fence.enter():
            raise _Cancelled()
        try:
            return read()
        finally:
            fence.leave()

    def copy(self, view: np.ndarray, crc: bool = True) -> tuple[bytes, str | None]:
        """A WRITE's body copied out of the caller's memory (and its CRC32C), inside the fence: none once cancelled."""
        return self._fenced(lambda: (view.tobytes(), crc32c_b64(view) if crc else None))

    def crc(self, view: np.ndarray) -> str:
        """The CRC32C of a whole object, read from the caller's memory inside the fence: none once cancelled."""
        return self._fenced(lambda: crc32c_b64(view))

    def one(self, row: int, part: int, start: int, count: int) -> None:
        view = self.view(row, start, count)
        if part < 0:
            if self.write:
                body, crc = self.copy(view)  # raises once cancelled: nothing sent, the object untouched
                try:
                    self.b.put(self.req, row, body, crc)  # type: ignore[arg-type]
                except BaseException as exc:  # one attempt refused means nothing was stored; else no telling
                    refused = getattr(exc, "status", None) and _retry_attempts(exc) == 0
                    self.outcomes[row] = "aborted" if refused else "unknown"
                    raise
                self.outcomes[row] = "committed"
            else:
                self.b.get(self.req, row, start, count, view, self.completion)
            return
        g = self.groups[row]
        ok = False
        try:
            if self.write:
                self.upload_part(g, part, view)
            else:
                info = self.b.get(self.req, row, start, count, view, self.completion)
                with g.lock:
                    g.etags.append(info["etag"])
                    g.meta_crc, g.total = info["crc"], info["total"]
            ok = True
        finally:
            with g.lock:
                g.left -= 1
                g.failed |= not ok
                last = g.left == 0
            if last and ok and not g.failed:
                self.finish_group(g)

    # -- multipart uploads ---------------------------------------------------
    def upload_part(self, g: _Group, part: int, view: np.ndarray) -> None:
        b, req, p = self.b, self.req, self.req.plan
        bucket, key = p.bucket[g.row], p.key[g.row]
        with g.lock:
            if g.failed:
                raise _Cancelled()
            if g.upload_id is None:
                whole = self.view(g.row, 0, p.len[g.row])
                g.marker = os.urandom(12).hex()
                meta = {CRC_META: self.crc(whole), UPLOAD_META: g.marker}
                kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Metadata": meta}
                if b._use_native():
                    kw["ChecksumAlgorithm"] = "CRC32C"
                g.upload_id = self.create_upload(g.row, kw)
                g.etags = [None] * g.nparts
        if self.completion.cancelled:
            raise _Cancelled()
        body, crc = self.copy(view, crc=b._use_native())
        kw = {"Bucket": bucket, "Key": key, "UploadId": g.upload_id, "PartNumber": part + 1, "Body": body}
        if crc is not None:
            kw["ChecksumAlgorithm"] = "CRC32C"
            kw["ChecksumCRC32C"] = crc
        resp = b._call(b._client.upload_part, req=req, row=g.row, what=f"UploadPart {part + 1}", **kw)
        entry = {"PartNumber": part + 1, "ETag": resp["ETag"]}
        if crc is not None:
            entry["ChecksumCRC32C"] = crc
        g.etags[part] = entry

    def create_upload(self, row: int, kw: dict[str, Any]) -> str:
        """CreateMultipartUpload, retried here rather than by botocore: an attempt whose answer was lost may have
        started an upload nobody knows the id of, pending (invisible, billed) forever; such uploads of the key
        started since that attempt are found and aborted."""
        b = self.b
        tries = int(b.retries["total_max_attempts"])
        lost_since: datetime | None = None
        upload_id: str | None = None
        b._calling.once = True
        try:
            for attempt in itertools.count(1):
                sent = datetime.now(timezone.utc)
                try:
                    resp = b._call(
                        b._client.create_multipart_upload, req=self.req, row=row, what="CreateMultipartUpload", **kw
                    )
                    upload_id = resp["UploadId"]
                    return upload_id
                except ObjectStoreError as exc:
                    if exc.status is None:
                        lost_since = lost_since or sent
                    elif exc.status not in _RETRY_STATUS:
                        raise
                    # botocore's jittered backoff, shorter
                    if attempt >= tries or not b._wait_to_retry(random.uniform(0, min(1.0, 0.05 * 2**attempt))):
                        raise
        finally:
            b._calling.once = False
            if lost_since is not None:
                self.abort_strays(row, lost_since, upload_id)
        raise AssertionError("unreachable")

    def abort_strays(self, row: int, since: datetime, keep: str | None) -> None:
        """Abort the uploads of row's key started since ``since`` (less clock slack) but ``keep``."""
        p = self.req.plan
        bucket, key = p.bucket[row], p.key[row]
        client = self.b.settle_client()
        try:
            found = client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads") or []
            for upload in found:
                mine = upload.get("Initiated") and upload["Initiated"] >= since - timedelta(seconds=_CLOCK_SLACK_S)
                if upload.get("Key") == key and upload.get("UploadId") != keep and mine:
                    client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"])
        except Exception as exc:  # it stays pending: a lifecycle rule reaps it
            log.warning("cannot abort the uploads of %r a lost CreateMultipartUpload may have started: %s", key, exc)

    def finish_group(self, g: _Group) -> None:
        b, req, p = self.b, self.req, self.req.plan
        row = g.row
        if self.write:
            if self.completion.cancelled:
                return  # cleanup aborts it
            try:
                b._call(
                    b._client.complete_multipart_upload,
                    req=req,
                    row=row,
                    what="CompleteMultipartUpload",
                    Bucket=p.bucket[row],
                    Key=p.key[row],
                    UploadId=g.upload_id,
                    MultipartUpload={"Parts": g.etags},
                )
            except DatamoverError:
                # the server may have completed it and the answer got lost: find out, abort if not
                if self.settle(g) != "committed":
                    raise
                log.warning("CompleteMultipartUpload of %r got no answer, but the object is committed", p.key[row])
            g.finished = True
            self.outcomes[row] = "committed"
            return
        bucket, key = p.bucket[row], p.key[row]
        if len(set(g.etags)) > 1:
            raise ObjectStoreError(
                f"s3://{bucket}/{key} changed while it was being read (ETags {sorted(set(map(str, g.etags)))})",
                bucket=bucket, key=key, code="ObjectChanged", errno=errno_mod.EIO,
                index=req.caller_index(row), backend=b.name,
            )  # fmt: skip
        if p.off[row] == 0 and g.total == p.len[row]:
            dst = self.view(row, 0, p.len[row])
            try:
                b._verify(req, row, dst, None, g.meta_crc)
            except ChecksumMismatch:
                _zero(self.completion, dst)  # never leave unverified bytes behind
                raise
        g.finished = True

    def cleanup(self) -> None:
        """Abort every multipart upload this post started and did not complete (no half object is visible), and
        say on the transfer's error which objects it committed and which uploads it aborted. A row read in parts
        that did not complete (a part failed, or the object changed between parts) is zeroed: its parts landed
        unverified."""
        for g in self.groups.values():
            if self.write and g.upload_id is not None and not g.finished and g.row not in self.outcomes:
                self.settle(g)
            elif not self.write and not g.finished and g.left < g.nparts:
                _zero(self.completion, self.view(g.row, 0, self.req.plan.len[g.row]))
        err = self.completion.error
        if self.write and err is not None:
            mine = {self.req.caller_index(r): self.outcomes.get(r, "untouched") for r in range(len(self.req.plan.key))}
            with self.lock:
                err.outcomes = {**(getattr(err, "outcomes", None) or {}), **mine}

    def settle(self, g: _Group) -> str:
        """Whether ``g``'s upload was committed, after a CompleteMultipartUpload with no answer or none at all.

        The visible object carrying this upload's marker means committed; else the upload is aborted, which makes
        it impossible to complete later (an abort that finds no upload looks once more: the complete may just have
        landed). "unknown" only when the server cannot be asked.
        """
        p, client = self.req.plan, self.b.settle_client()
        bucket, key = p.bucket[g.row], p.key[g.row]
        outcome = "unknown"
        try:
            if self._marker_visible(g):
                outcome = "committed"
            else:
                try:
                    client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=g.upload_id)
                    outcome = "aborted"
                except Exception as exc:
                    if _error_code(exc) != "NoSuchUpload":
                        raise
                    outcome = "committed" if self._marker_visible(g) else "aborted"
        except Exception as exc:  # the upload stays invisible unless completed; a lifecycle rule reaps it
            log.warning("cannot tell whether the multipart upload %s of %r was committed: %s", g.upload_id, key, exc)
        self.outcomes[g.row] = outcome
        return outcome

    def _marker_visible(self, g: _Group) -> bool:
        p = self.req.plan
        try:
            head = self.b.settle_client().head_object(Bucket=p.bucket[g.row], Key=p.key[g.row])
        except Exception as exc:
            if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return (head.get("Metadata") or {}).get(UPLOAD_META) == g.marker


class _Cancelled(DatamoverError):
    """Internal: a part noticed the transfer was cancelled (the completion already holds the reason)."""

    def __init__(self) -> None:
        super().__init__("cancelled", backend="s3")


def _read_into(
    body: Any,
    dst: np.ndarray,
    stage: memoryview,
    fence: ReadFence,
    crc: bool = False,
    got: list[int] | None = None,
    ended: bool = False,
) -> str | None:
    """Fill ``dst`` from a response body a chunk at a time through ``stage``, each chunk copied inside ``fence``;
    with ``crc``, return the CRC32C of what was read. ``got[0]`` counts the bytes read; a body that ends early
    raises _Ended with ``ended`` (the answer had no length: the object is shorter), else ConnectionResetError."""
    import crc32c

    mv = memoryview(dst).cast("B")
    done = got if got is not None else [0]
    value = 0
    while done[0] < mv.nbytes:
        if fence.cancelled:
            raise _Cancelled()
        at = done[0]
        n = body.readinto(stage[: min(stage.nbytes, mv.nbytes - at)])
        if not n:
            if ended:
                raise _Ended()
            raise ConnectionResetError(f"the response ended after {at} of {mv.nbytes} bytes")
        if crc:
            value = crc32c.crc32c(stage[:n], value)
        _land(fence, mv, at, stage[:n])
        done[0] = at + n
    return _b64(value) if crc else None


def _land(fence: ReadFence, dst: memoryview, at: int, data: Any) -> None:
    """Copy ``data`` into the caller's memory at ``at``, inside the fence; raises _Cancelled (copying nothing) once
    the transfer was cancelled."""
    if not fence.enter():
        raise _Cancelled()
    try:
        dst[at : at + len(data)] = data
    finally:
        fence.leave()


def _zero(fence: ReadFence, dst: np.ndarray) -> None:
    """Zero bytes that landed unverified, inside the fence; not once the transfer was released or timed out (the
    memory is the caller's again)."""
    if fence.join():
        try:
            dst[:] = 0
        finally:
            fence.leave()


def _at_end(body: Any) -> bool:
    """Whether a body read to the bytes asked for has ended (reads at most one more byte)."""
    return not body.read(1)


class _Ended(Exception):
    """Internal: a body without Content-Length ended before the bytes asked for."""


def _check_params(p: Mapping[str, Any]) -> None:
    """Refuse, naming the parameter, what botocore or the pool would refuse later with an untyped error."""
    from urllib.parse import urlsplit

    for name, bound in (("concurrency", "an integer >= 1"), ("max_attempts", "an integer >= 1"),
                        ("connect_timeout", "seconds > 0"), ("read_timeout", "seconds > 0")):  # fmt: skip
        value = p[name]
        if value is None and name == "max_attempts":
            continue
        try:
            ok = int(value) >= 1 if bound.startswith("an integer") else float(value) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidParameter(f"{name} must be {bound}, got {value!r}", backend="s3")
    url = p["endpoint_url"]
    if url is not None:
        try:
            parts = urlsplit(url) if isinstance(url, str) else None
            ok = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:
            ok = False
        if not ok:
            raise InvalidParameter(f"endpoint_url must be an http(s)://host[:port] URL, got {url!r}", backend="s3")
    region = p["region"]
    if region is not None and not (isinstance(region, str) and _REGION.fullmatch(region)):
        raise InvalidParameter(f"region must be a region name such as 'us-east-1', got {region!r}", backend="s3")


def _refuses_checksum(exc: BaseException) -> bool:
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


def _error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError (or the one a typed error wraps), else ""."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


def _retry_attempts(exc: BaseException) -> int | None:
    """How many times botocore retried the call that failed with ``exc`` (or the error it wraps); None: unknown."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            attempts = response.get("ResponseMetadata", {}).get("RetryAttempts")
            return attempts if isinstance(attempts, int) else None
    return None


class RetryNotSent(Exception):
    """A retry botocore was about to send for a transfer cancelled or past its deadline (it was not sent)."""


def _bound_retries(
    client: Any,
    mode: str,
    attempts: int,
    session: Any,
    may_retry: Callable[[float], bool],
    stopped: Callable[[], bool],
) -> None:
    """Put botocore's retry handler of ``mode`` behind ``may_retry(delay)``, and send no retry once ``stopped()``.

    ``may_retry`` waits out the backoff itself, or refuses the retry (a transfer cancelled, or one whose deadline
    comes first). Every attempt after the first is checked again just before it is sent, after adaptive mode's rate
    limiter, which may hold it: a retry found ``stopped()`` there is not sent and fails the call with RetryNotSent.
    Standard and adaptive retries get a quota that never runs out: botocore spends a shared quota of 500 on retries
    (14 per connection error), refilled only by calls that succeed, so after an outage of a few dozen failed calls one
    dropped connection would fail a transfer at once. The attempts per call stay bounded by ``attempts``.
    """
    import sys

    from botocore import retryhandler, translate
    from botocore.retries import quota, standard

    svc = client.meta.service_model.service_id.hyphenize()
    handler: Callable[..., float | None]
    if mode == "legacy":  # as botocore's ClientCreator._register_legacy_retries builds it
        prefix = client.meta.service_model.endpoint_prefix
        model = session.get_component("data_loader").load_data("_retry")
        config = translate.build_retry_config(
            prefix, model.get("retry", {}), model.get("definitions", {}), {"max_attempts": attempts - 1}
        )
        handler = retryhandler.create_retry_handler(config, prefix)
    else:
        adapter = standard.RetryEventAdapter()
        detector = standard.ThrottlingErrorDetector(adapter)
        handler = standard.RetryHandler(
            retry_policy=standard.RetryPolicy(
                retry_checker=standard.StandardRetryConditions(max_attempts=attempts),
                retry_backoff=standard.ExponentialBackoff(service_name=svc, throttling_detector=detector),
            ),
            retry_event_adapter=adapter,
            retry_quota=standard.RetryQuotaChecker(quota.RetryQuota(sys.maxsize), detector),
            service_name=svc,
        ).needs_retry
    unique_id = f"retry-config-{svc}"
    client.meta.events.unregister(f"needs-retry.{svc}", unique_id=unique_id)

    def needs_retry(**kwargs: Any) -> float | None:
        if stopped():
            return None
        delay = handler(**kwargs)
        # 0: botocore sleeps no more (may_retry waited); None: botocore raises this attempt's error
        return 0 if delay is not None and delay is not False and may_retry(delay) else None

    def before_send(request: Any, **_: Any) -> None:
        retries = (getattr(request, "context", None) or {}).get("retries") or {}
        if retries.get("attempt", 1) > 1 and stopped():
            raise RetryNotSent(
                f"retry {retries['attempt'] - 1} not sent: the transfer was cancelled or is past its deadline"
            )

    client.meta.events.register(f"needs-retry.{svc}", needs_retry, unique_id=unique_id)
    # the generic event, last: after adaptive mode's rate limiter (also on "before-send"), which may hold a retry
    client.meta.events.register_last("before-send", before_send, unique_id=f"dm-retry-guard-{svc}")
