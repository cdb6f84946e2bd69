"""The private L4 bucket (`l4_pool.backend: s3`) as the cache asks it directly, not through transfers.

A chunk is `replica_count` objects `<prefix><ChunkKey.digest()>.<r>` (`l4_pool.prefix`, `kv/` unless set; the
prefix is one instance's alone). When the cache evicts a chunk from L4, or drops one whose bytes failed, its
objects are deleted (DeleteObjects, up to 1,000 names a call), so the prefix holds what the L4 index holds, not
every chunk ever demoted. The index (the keys L4 holds, oldest placement first) is the object
`<prefix>datamover-l4-index`: written at start marked in use, every `INDEX_INTERVAL_S` while L4 changes (in the
background), and at close marked clean. The next cache on the prefix reads it back, checks every field, and
adopts those chunks (reads of them are verified against the CRC32C each object was written with). After a run
that did not close, the prefix is listed first: chunks of the index whose objects are gone are not adopted, and
the objects the dead run wrote after its last index (whose keys no index names) are deleted, so a crash neither
serves a missing chunk as held nor leaks storage, and loses what L4 took in its last interval. Every index write
is conditional on the index being the one this cache last read or wrote (S3's If-Match / If-None-Match): a
second cache on the prefix takes it over, and the first, told so at its next write, stops deleting and
indexing there; two starting at once, one is refused (ConfigError).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import msgpack

from ..agents import Agent
from ..errors import ConfigError
from .config import L4Config
from .keys import ChunkKey, key_from_fields

log = logging.getLogger("datamover.kvcache")

INDEX_NAME = "datamover-l4-index"
INDEX_FORMAT = "datamover-l4-index/2"
#: indexes of chunks named by the digest before 2 (fields joined by '|', which two keys could share): not used,
#: so their objects are found as orphans and deleted
OLD_FORMATS = ("datamover-l4-index/1",)
_DELETE_BATCH = 1000  # S3's limit for one DeleteObjects call
CALL_TIMEOUT_S = 10.0  # each call to the store ends within this
RETRY_S = 30.0  # after a delete the store did not answer, the next try waits this long
PENDING_MAX = 100_000  # chunks whose deletes wait at the most (beyond, the oldest are given up)
INDEX_INTERVAL_S = 60.0  # while L4 changes, its index is written at most this often (what a crash can lose)
_CHUNK_NAME = re.compile(r"([0-9a-f]{32})\.([0-9]{1,4})")  # after the prefix: <digest>.<replica>
_INDEX_BYTES_PER_KEY = 1024  # bound on what is read back: a key's fields as msgpack, generous


class PrivateBucket:
    """One instance's L4 bucket: deletes of evicted chunks, and the index kept across restarts.

    Its calls are made outside transfers, so they get a deadline of their own: a client whose calls end within
    `timeout_s`. Deletes the store does not answer wait (at most `PENDING_MAX` chunks) and are tried again with
    the next ones once `RETRY_S` has passed, so a store that hangs costs the cache one bounded wait per
    `RETRY_S`, not one per operation; a chunk written again meanwhile is not deleted.
    """

    def __init__(
        self, agent: Agent, config: L4Config, chunk_bytes: int, capacity: int, timeout_s: float | None = None
    ) -> None:
        timeout = CALL_TIMEOUT_S if timeout_s is None else timeout_s
        self.client = agent.backend("s3").bounded_client(timeout)  # type: ignore[attr-defined]
        self.bucket = config.bucket
        self.prefix = config.prefix
        self.index_object = config.prefix + INDEX_NAME
        self.replicas = config.replica_count
        self.chunk_bytes = chunk_bytes
        self.capacity = capacity
        self.delete_failures = 0  # object names given up on (refused, or forgotten past PENDING_MAX)
        self.clock: Callable[[], float] = time.monotonic
        self._pending: dict[ChunkKey, range] = {}  # chunks whose objects are to go, and which replicas
        self._gc_failed = False  # objects no index names may be left (not all deleted): the next start looks again
        self._retry_at = 0.0
        self.changed = False  # L4 took or dropped chunks since the index was last written
        self._last_save: float | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="dm-l4-index")
        self._saving: Future | None = None
        self.index_age_s: float | None = None  # how long ago the index found at start was written
        self.lost = False  # another cache replaced the index: this one leaves the prefix's objects alone
        self._etag: str | None = None  # of the index as this cache last read or wrote it
        self._conditional = True

    @property
    def waiting(self) -> bool:
        """Whether deletes wait for the store (tried again with the next delete, once `RETRY_S` has passed)."""
        return bool(self._pending)

    def stats(self) -> dict[str, int]:
        """Object names given up on (refused, or forgotten while the store was down), chunks whose deletes wait."""
        return {"objects_not_deleted": self.delete_failures, "deletes_waiting": len(self._pending)}

    def names(self, key: ChunkKey, replicas: Iterable[int]) -> list[str]:
        """The object names of `key`'s replicas (full keys in the bucket)."""
        return [chunk_object(self.prefix, key, r) for r in replicas]

    def delete(self, keys: Iterable[ChunkKey], replicas: range | None = None, keep: Container[ChunkKey] = ()) -> int:
        """Delete the objects of `keys` (every replica, or those of `replicas`) and of the chunks still waiting,
        but not those of chunks in `keep` (written again since). Returns how many names the store refused or
        could not be asked about (logged; they only cost storage, every read of them is checked)."""
        if self.lost:
            return 0
        reps = range(self.replicas) if replicas is None else replicas
        for key in keys:
            self._pending[key] = reps
        if len(self._pending) > PENDING_MAX:
            over = list(self._pending)[: len(self._pending) - PENDING_MAX]
            for key in over:
                self.delete_failures += len(self._pending.pop(key))
            log.warning("l4_pool: %d evicted chunks' objects forgotten, never deleted (the store is down)", len(over))
        if not self._pending or self.clock() < self._retry_at:
            return 0
        waiting, self._pending = self._pending, {}
        todo = [(k, r) for k, r in waiting.items() if k not in keep]
        names = [name for key, reps in todo for name in self.names(key, reps)]
        owner = [i for i, (_, reps) in enumerate(todo) for _ in reps]  # names[n] is an object of todo[owner[n]]
        refused = 0
        for lo in range(0, len(names), _DELETE_BATCH):
            batch = names[lo : lo + _DELETE_BATCH]
            try:
                refused += self._delete_call(batch)
            except Exception as exc:  # unreachable, or no answer in time: this batch and the rest wait
                self._retry_at = self.clock() + RETRY_S
                self._pending.update(todo[i] for i in sorted(set(owner[lo:])))
                log.warning(
                    "l4_pool: deleting %d evicted object(s) of s3://%s failed (%s); tried again in %.0f s",
                    len(names) - lo, self.bucket, exc, RETRY_S,
                )  # fmt: skip
                self.delete_failures += refused
                return len(names) - lo + refused
        self.delete_failures += refused
        return refused

    def checkpoint(self, snapshot: Callable[[], list[ChunkKey]]) -> None:
        """Write the index (of `snapshot()`, the keys L4 holds) in the background if L4 changed and
        `INDEX_INTERVAL_S` has passed since the last one: after a crash the next start keeps every chunk it
        names whose objects are still there, so a crash loses at most what that interval wrote."""
        now = self.clock()
        if self._last_save is None:
            self._last_save = now
        if self.lost or not self.changed or now - self._last_save < INDEX_INTERVAL_S:
            return
        if self._saving is not None and not self._saving.done():
            return
        self.changed, self._last_save = False, now
        self._saving = self._saver.submit(self.save, snapshot(), False)

    def close(self, keys: Sequence[ChunkKey]) -> None:
        """Wait for a checkpoint being written, then write the index marked clean."""
        self._saver.shutdown(wait=True)
        self.save(keys, clean=True)

    def save(self, keys: Sequence[ChunkKey], clean: bool) -> None:
        """Write the index of the chunks L4 holds: a checkpoint (`clean` False: a run that does not close leaves it
        so, and the next start looks at the prefix itself) or at close (`clean` when every object the run dropped
        was deleted). If it cannot be written, logged; after a takeover, never again (`lost`)."""
        if self.lost:
            return
        try:
            self._put_index(self._index_body(keys, clean))
        except _TakenOver:
            self.lost = True
            log.error(
                "l4_pool: another cache replaced the index of s3://%s/%s: it uses this prefix now; this cache no "
                "longer deletes or indexes there (give each cache an l4_pool.prefix of its own)",
                self.bucket, self.prefix,
            )  # fmt: skip
        except Exception as exc:
            log.warning(
                "l4_pool: index s3://%s/%s not written (%s): the %d chunks there are not found again next start",
                self.bucket, self.index_object, exc, len(keys),
            )  # fmt: skip

    def _index_body(self, keys: Sequence[ChunkKey], clean: bool) -> bytes:
        """The index as msgpack: marked clean only when nothing under the prefix is left that it does not name. A
        key msgpack cannot hold is left out (logged), not the whole index; the index is then not clean."""
        packed: list[bytes] = []
        for k in keys:
            try:
                packed.append(msgpack.packb(list(k)))
            except (TypeError, OverflowError, ValueError) as exc:
                log.warning("l4_pool: key %.80r cannot be indexed (%s): its chunk is not found after a restart", k, exc)
        index = {"format": INDEX_FORMAT, "chunk_bytes": self.chunk_bytes, "replicas": self.replicas}
        index["clean"] = clean and not self._pending and not self._gc_failed and len(packed) == len(keys)
        index["owner"] = f"{socket.gethostname()[:200]} pid {os.getpid()}"
        packer = msgpack.Packer()
        head = packer.pack_map_header(len(index) + 1) + b"".join(packer.pack(x) for kv in index.items() for x in kv)
        return head + packer.pack("keys") + packer.pack_array_header(len(packed)) + b"".join(packed)

    def _put_index(self, body: bytes) -> None:
        """Write the index only over the one this cache last read or wrote (S3's conditional writes), so two caches
        on one prefix find out; _TakenOver if another wrote it meanwhile. A store without conditional writes
        gets plain ones (said once)."""
        cond: dict[str, str] = {}
        if self._conditional and self._etag != _UNKNOWN:
            cond = {"IfMatch": self._etag} if self._etag else {"IfNoneMatch": "*"}
        try:
            resp = self.client.put_object(Bucket=self.bucket, Key=self.index_object, Body=body, **cond)
        except Exception as exc:
            code, status = _error(exc)
            if "IfMatch" in cond and _not_found(exc):
                self._etag = None  # the index was deleted (a lifecycle rule, a person): write it anew
                return self._put_index(body)
            if cond and (status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")):
                raise _TakenOver() from exc
            if not cond or not (status == 501 or code == "NotImplemented"):
                raise
            self._conditional = False
            log.warning(
                "l4_pool: s3://%s takes no conditional writes: two caches on one prefix are not detected", self.bucket
            )
            resp = self.client.put_object(Bucket=self.bucket, Key=self.index_object, Body=body)
        self._etag = resp.get("ETag")

    def load(self) -> list[ChunkKey]:
        """The chunks the index an earlier run left says the prefix holds, at most `capacity` (the newest); then
        the index is marked as in use. After a run that did not close (or with no index), the prefix is listed:
        only chunks whose objects are there are kept, and every other chunk object under it is deleted (what
        the crashed run wrote: its keys are not known). Chunks past the capacity, and replicas beyond
        `replica_count`, are deleted. An index that cannot be read or parsed counts as none (logged). A bucket
        the store says does not exist is a ConfigError naming `l4_pool.bucket` (L4 would miss every chunk)."""
        self._check_bucket()
        index = self._read_index()
        if self._etag == _UNKNOWN:  # the store did not answer: asking it more now only delays the start
            log.warning(
                "l4_pool: s3://%s/%s did not answer at start: L4 starts cold, the next index written replaces "
                "whatever is there, and the prefix is cleaned at the next start", self.bucket, self.prefix,
            )  # fmt: skip
            self._gc_failed = True  # objects no index of this run names may lie there: never marked clean
            return []
        keys: list[ChunkKey] = []
        replicas, clean, owner = self.replicas, False, "unknown"
        if index is not None and index.chunk_bytes != self.chunk_bytes:
            log.warning(
                "l4_pool: index s3://%s/%s is of %d-byte chunks, this cache's are %d: its chunks are not used",
                self.bucket, self.index_object, index.chunk_bytes, self.chunk_bytes,
            )  # fmt: skip
        elif index is not None:
            keys, replicas, owner = list(dict.fromkeys(index.keys)), index.replicas, index.owner
            clean = index.clean and not index.skipped  # else the skipped keys' objects are found and deleted
            if index.skipped:
                log.warning(
                    "l4_pool: %d keys of index s3://%s/%s are not chunk keys: skipped, their objects deleted",
                    index.skipped, self.bucket, self.index_object,
                )  # fmt: skip
        if index is not None and not index.clean and (self.index_age_s or 0.0) < 2 * INDEX_INTERVAL_S:
            log.warning(
                "l4_pool: s3://%s/%s is marked in use by %s, its index written %.0f s ago: if that cache still runs,"
                " two caches share this prefix and delete each other's chunks (give each an l4_pool.prefix of its"
                " own); if it died, this start cleans up after it", self.bucket, self.prefix, owner,
                self.index_age_s or 0.0,
            )  # fmt: skip
        if not clean:
            keys = self._collect(keys, owner)
        kept, dropped = keys[-self.capacity :], keys[: max(0, len(keys) - self.capacity)]
        if dropped:
            self.delete(dropped, range(replicas))
        if replicas > self.replicas:
            self.delete(kept, range(self.replicas, replicas))
        try:  # marked in use, and this cache's from now on: a cache starting on it meanwhile makes this fail
            self._put_index(self._index_body(kept, clean=False))
        except _TakenOver:
            raise ConfigError(
                "kv_cache_tiered.l4_pool.prefix",
                f"s3://{self.bucket}/{self.prefix} was taken by another cache starting at the same time; give each "
                "cache a prefix of its own",
            ) from None
        except Exception as exc:
            log.warning("l4_pool: index s3://%s/%s not written (%s)", self.bucket, self.index_object, exc)
        return kept

    def _collect(self, keys: list[ChunkKey], owner: str) -> list[ChunkKey]:
        """`keys` whose objects the prefix holds; every other chunk object under the prefix is deleted."""
        listed = self._list()
        if listed is None:
            return keys
        whole: set[str] = set()  # digests with a replica of this cache's chunk size
        ours: list[tuple[str, str, int]] = []  # (name, digest, size) of every chunk object
        for name, size in listed.items():
            m = _CHUNK_NAME.fullmatch(name[len(self.prefix) :])
            if m is not None:
                ours.append((name, m[1], size))
                if size == self.chunk_bytes:
                    whole.add(m[1])
        kept = [k for k in keys if k.digest() in whole]
        keep = {k.digest() for k in kept}
        orphans = [name for name, digest, size in ours if digest not in keep or size != self.chunk_bytes]
        if orphans or len(kept) < len(keys):
            log.warning(
                "l4_pool: s3://%s/%s was not closed by the cache that used it (%s): %d of the %d chunks its index "
                "names found, %d other chunk objects (written after its index) deleted",
                self.bucket, self.prefix, owner, len(kept), len(keys), len(orphans),
            )  # fmt: skip
        for lo in range(0, len(orphans), _DELETE_BATCH):
            batch = orphans[lo : lo + _DELETE_BATCH]
            try:
                failed = self._delete_call(batch)
            except Exception as exc:
                log.warning("l4_pool: %d object(s) of s3://%s not deleted: %s", len(batch), self.bucket, exc)
                failed = len(batch)
            if failed:
                self._gc_failed = True
                self.delete_failures += failed
        return kept

    def _list(self) -> dict[str, int] | None:
        """Object name -> size of what lies directly under the prefix; None if it cannot be listed whole (the
        store fails, or holds more than a cache of this capacity could have left: then it is not ours alone)."""
        limit = 4 * self.capacity + 10_000
        found: dict[str, int] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"
            )
            for page in pages:
                for obj in page.get("Contents") or []:
                    found[str(obj.get("Key"))] = int(obj.get("Size", -1))
                if len(found) > limit:
                    log.warning(
                        "l4_pool: s3://%s/%s holds over %d objects, more than this cache could have left: not "
                        "cleaned", self.bucket, self.prefix, limit,
                    )  # fmt: skip
                    return None
        except Exception as exc:
            log.warning("l4_pool: s3://%s/%s cannot be listed (%s): not cleaned", self.bucket, self.prefix, exc)
            return None
        return found

    def _delete_call(self, names: list[str]) -> int:
        """Delete up to 1,000 objects by name; how many the store refused (logged). Raises if it cannot be asked."""
        resp = self.client.delete_objects(
            Bucket=self.bucket, Delete={"Objects": [{"Key": n} for n in names], "Quiet": True}
        )
        errors = resp.get("Errors") or []
        if errors:
            log.warning(
                "l4_pool: %d object(s) of s3://%s not deleted (first: %s: %s); they stay until the bucket's "
                "lifecycle rules expire them",
                len(errors), self.bucket, errors[0].get("Key"), errors[0].get("Message"),
            )  # fmt: skip
        return len(errors)

    def _check_bucket(self) -> None:
        """ConfigError when the store answers that the bucket does not exist; anything else is left to the
        index read (a store that does not answer starts L4 cold; a 403 may only mean no ListBucket right)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            code, status = _error(exc)
            if status == 404 or code in ("404", "NoSuchBucket"):
                raise ConfigError(
                    "l4_pool.bucket", f"bucket {self.bucket!r} does not exist at the store; create it first"
                ) from None

    def _read_index(self) -> Index | None:
        where = f"s3://{self.bucket}/{self.index_object}"
        limit = 4096 + self.capacity * _INDEX_BYTES_PER_KEY
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.index_object)
            written = head.get("LastModified")
            if isinstance(written, datetime.datetime) and written.tzinfo is not None:
                self.index_age_s = (datetime.datetime.now(datetime.timezone.utc) - written).total_seconds()
            size = int(head.get("ContentLength", 0))
            if size > limit:
                log.warning(
                    "l4_pool: index %s is %d bytes, over the %d this capacity bounds: not used", where, size, limit
                )
                self._etag = head.get("ETag")
                return None
            resp = self.client.get_object(Bucket=self.bucket, Key=self.index_object, Range=f"bytes=0-{limit - 1}")
            self._etag = resp.get("ETag")
            data = resp["Body"].read(limit + 1)
        except Exception as exc:
            if _not_found(exc):
                return None
            log.warning("l4_pool: index %s unreadable (%s): not used", where, exc)
            self._etag = _UNKNOWN
            return None
        try:
            return parse_index(data)
        except ValueError as exc:
            log.warning("l4_pool: index %s not used: %s", where, exc)
            return None


class Index(NamedTuple):
    """An L4 index as read back."""

    keys: list[ChunkKey]
    chunk_bytes: int
    replicas: int
    clean: bool  # written at a close that deleted every object the run dropped
    owner: str  # host and pid of the cache that wrote it
    skipped: int = 0  # keys that were not chunk keys: left out (their objects are deleted as orphans)


def parse_index(data: bytes) -> Index:
    """The index in an index object's bytes; ValueError naming what is wrong (it came from the network: every
    field is checked before the cache trusts it)."""
    try:
        index: Any = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(index, dict) and index.get("format") in OLD_FORMATS:
        raise ValueError(f"a {index['format']} index, whose chunk objects have names {INDEX_FORMAT} does not use")
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise ValueError(f"not a {INDEX_FORMAT} index")
    chunk_bytes, replicas, fields = index.get("chunk_bytes"), index.get("replicas"), index.get("keys")
    clean, owner = index.get("clean"), index.get("owner")
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes {chunk_bytes!r:.40} is not a size")
    if type(replicas) is not int or not 1 <= replicas <= 1024:
        raise ValueError(f"replicas {replicas!r:.40} out of range")
    if type(clean) is not bool or not isinstance(owner, str) or len(owner) > 256:
        raise ValueError(f"clean {clean!r:.10} / owner {owner!r:.40} malformed")
    if not isinstance(fields, list):
        raise ValueError("keys is not a list")
    keys: list[ChunkKey] = []
    for f in fields:  # a key that is not one is skipped, not the whole index: its objects are then orphans
        try:
            keys.append(key_from_fields(f))
        except ValueError:
            pass
    return Index(keys, chunk_bytes, replicas, clean, owner, len(fields) - len(keys))


def chunk_object(prefix: str, key: ChunkKey, replica: int) -> str:
    """The object holding replica `replica` of chunk `key` under `prefix` (what `_CHUNK_NAME` reads back)."""
    return f"{prefix}{key.digest()}.{replica}"


_UNKNOWN = "?"  # the index's ETag when the store did not answer: the next write is unconditional


class _TakenOver(Exception):
    """Another cache wrote the index since this one last read or wrote it."""


def _error(exc: BaseException) -> tuple[str, int | None]:
    """(error code, HTTP status) of a botocore ClientError; ("", None) for anything else."""
    response = getattr(exc, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(response.get("Error", {}).get("Code", "")), status if isinstance(status, int) else None


def _not_found(exc: BaseException) -> bool:
    code, status = _error(exc)
    return status == 404 or code in ("404", "NoSuchKey", "NotFound")
