"""One post of a transfer, executed: its runners pull objects and parts from one shared list, PUT and GET them, run
multipart uploads to their end (or abort them) and say on a failed WRITE's error what each row's object holds."""

from __future__ import annotations

import errno as errno_mod
import itertools
import logging
import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import numpy as np

from ...errors import ChecksumMismatch, DatamoverError, ObjectStoreError
from ..base import Completion, TransferRequest, clock, typed_error
from ..fence import ReadFence
from .bodies import Cancelled, zero
from .checksums import CRC_META, crc32c_b64
from .errors import error_code, retry_attempts

log = logging.getLogger("datamover.s3")

#: metadata key marking a multipart upload, so that an unanswered CompleteMultipartUpload can be resolved
UPLOAD_META = "dm-upload"
#: HTTP statuses of a CreateMultipartUpload worth another try (throttled, server busy or failing)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
#: how much earlier than our clock says the store may have stamped an upload we started
_CLOCK_SLACK_S = 2.0

_T = TypeVar("_T")


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


class Run:
    """One post of a request: runners pull tasks from a shared counter until done or cancelled."""

    def __init__(self, req: TransferRequest, backend: Any, completion: ReadFence, runners: int) -> None:
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
        """`read()` of the caller's memory inside the fence; raises Cancelled (reading nothing) once cancelled."""
        fence = self.completion
        if not fence.enter():
            raise Cancelled()
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
                    refused = getattr(exc, "status", None) and retry_attempts(exc) == 0
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
                raise Cancelled()
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
            raise Cancelled()
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
                zero(self.completion, dst)  # never leave unverified bytes behind
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
                zero(self.completion, self.view(g.row, 0, self.req.plan.len[g.row]))
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
                    if error_code(exc) != "NoSuchUpload":
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
            if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return (head.get("Metadata") or {}).get(UPLOAD_META) == g.marker
