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

import errno as errno_mod
import importlib.util
import logging
import os
import re
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...descriptors import MemType
from ...errors import (
    ChecksumMismatch,
    DatamoverError,
    ObjectStoreError,
    OverlappingDestination,
)
from ...units import MiB
from ..base import Backend, BackendHost, Completion, TransferRequest, refuse_offset_writes
from ..fence import ReadFence
from .bodies import Ended, at_end, land, read_into, zero
from .checksums import CRC_META, crc32c_b64
from .client import S3Clients
from .errors import object_store_error, refuses_checksum
from .params import DEFAULT_PARAMS, LOOSE_PARAMS, check_params
from .retries import DeadlineRetries
from .run import Run

log = logging.getLogger("datamover.s3")

_MAX_PARTS = 10_000

#: whole objects up to this size are verified before they touch the destination; larger ones land, then are checked
_VERIFY_BEFORE_COPY = 1 * MiB
_READ_CHUNK = 1 * MiB
#: S3 checksums botocore verifies itself while a body is read to its end (CRC32C needs awscrt there: we do it)
_BOTOCORE_CHECKED = ("ChecksumCRC32", "ChecksumSHA1", "ChecksumSHA256")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


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


class S3Backend(S3Clients, DeadlineRetries, Backend):
    """Host memory to and from objects of registered buckets, through boto3 on a bounded pool."""

    name = "s3"
    pairs = frozenset({(MemType.DRAM, MemType.OBJ)})
    default_params = DEFAULT_PARAMS
    loose_params = LOOSE_PARAMS

    def __init__(self, host: BackendHost, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(host, params)
        p = self.params
        check_params(p)
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
        # (``Run.copy``), inside the fence: none is touched after ERR or release()
        completion = ReadFence(runners)
        if not runners:
            return completion
        run = Run(req, self, completion, runners)
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
            if self._native == "auto" and "ChecksumAlgorithm" in kw and refuses_checksum(exc):
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
                read_into(body, dst, stage, fence, got=got)  # a range: nothing to verify it against
                if length is None and not at_end(body):
                    why = f"sent more than the range of {count}"
                    raise self._bad_answer(req, row, start, resp, "RangeIgnored", why)
            elif length is not None and length < count:
                why = f"holds {length} bytes: [0, {count}) reads past its end"
                raise self._bad_answer(req, row, start + length, resp, "ShortRead", why)
            elif length is not None and length > count:
                read_into(body, dst, stage, fence, got=got)  # a prefix: nothing to verify it against
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
                land(fence, memoryview(dst).cast("B"), 0, data)
            else:
                try:
                    # CRC32C of each chunk while the next arrives
                    crc = read_into(body, dst, stage, fence, crc=True, got=got, ended=length is None)
                    if length is not None:
                        body.read()
                    elif not at_end(body):
                        total, crc = None, None  # a chunked answer of a longer object: a prefix read
                    if crc is not None:
                        self._verify(req, row, crc, resp, meta)
                except Exception:
                    zero(fence, dst)  # never leave unverified bytes behind
                    raise
        except DatamoverError:
            raise
        except Ended:
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
