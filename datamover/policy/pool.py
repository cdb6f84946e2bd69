"""The shared L4 pool as one cache instance sees it: lookups of what every instance put, and drain on retirement.

With `l4_pool.backend: mooncake`, L4 is a Mooncake Store pool that many instances share. A chunk is the pool
object `<bucket>/kv/<ChunkKey.digest()>`; the digest covers the model and tokenizer versions, so a chunk of
another model never matches. This module holds what the instance asks the pool directly (through the
mooncake backend's client, not through transfers): which keys it holds (`exists`, timed against
`p99_latency_budget_ms` and bounded: an answer that does not come in time is a miss, with a warning), and
`drain`, which copies every chunk whose only replicas live in this instance's memory to other members of the pool
(Mooncake copy tasks) before the instance leaves. Chunk bytes still move only through Agent transfers (`mover.py`).

Calls into the pool's client made without the cache's lock (a lookup, a drain) go through `calls`, so that the
cache's close waits for them before the client closes (a call into a closed Mooncake store crashes the process).

An object that failed its CRC32C when read is not deleted then (the pool is every instance's, and this one has
nothing to put in its place), so the instance remembers it as corrupt (`CorruptObjects`, bounded) and lookups
stop before it. When this instance writes that chunk anew, the corrupt object is removed first (the cache's
writes keep an object already there) and, once it is gone, forgotten as corrupt. Mooncake's existence check gives
no object version, so a rewrite by another instance is not seen: the chunk is a miss here until this instance
puts it again, or until `CORRUPT_MAX` newer corrupt objects pushed it out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.request
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..agents import Agent
from ..backends.mooncake import codes
from ..errors import ObjectStoreError, TransferStateError
from .config import L4Config
from .keys import ChunkKey

log = logging.getLogger("datamover.kvcache")

#: the most bytes read from the master's admin endpoint (key and segment listings): input from another process
ADMIN_LIMIT = 64 << 20
_LATENCY_WINDOW = 4096
#: a lookup's bound on the pool's answer: at least this, and this without a latency budget
LOOKUP_MIN_S = 0.1
LOOKUP_DEFAULT_S = 1.0
#: the most often a lookup the pool did not answer in time is logged
WARN_EVERY_S = 60.0
#: the most pool objects one instance remembers as corrupt (beyond, the oldest is forgotten)
CORRUPT_MAX = 4096


class CorruptObjects:
    """The chunks whose pool object failed its CRC32C, oldest first, at most `limit` of them."""

    def __init__(self, limit: int = CORRUPT_MAX) -> None:
        self.limit = limit
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: ChunkKey) -> None:
        """`key`'s object failed its check: remembered (as the newest), the oldest forgotten past the limit."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def discard(self, keys: Sequence[ChunkKey]) -> None:
        """Forget `keys` (this instance wrote their objects anew)."""
        for key in keys:
            self._keys.pop(key, None)


class SharedPool:
    """One instance's view of a Mooncake Store pool that other instances share."""

    def __init__(self, agent: Agent, config: L4Config) -> None:
        self.config = config
        self.client = agent.backend("mooncake").client
        self.prefix = f"{config.bucket}/kv/"
        self.budget_ms = float(config.p99_latency_budget_ms)
        self._lookup_s: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._warned = False
        #: the longest a lookup waits for the pool's answer (a stalled master holds a call ~30 s): ten times the p99
        #: budget, at least LOOKUP_MIN_S (a thread hop and a scheduler hiccup must not turn hits into misses), or
        #: LOOKUP_DEFAULT_S without a budget; an unanswered lookup is a miss
        self.bound_s = max(10 * self.budget_ms / 1e3, LOOKUP_MIN_S) if self.budget_ms else LOOKUP_DEFAULT_S
        self._warned_late_at = -WARN_EVERY_S
        self._unanswered = 0
        self.corrupt = CorruptObjects()
        self._users = threading.Condition()  # guards the two below: calls under way, and whether they are refused
        self._busy = 0
        self._closing = False

    def name(self, key: ChunkKey) -> str:
        """The chunk's object name inside the L4 registration (prefix ``kv/``)."""
        return f"kv/{key.digest()}"

    def pool_key(self, key: ChunkKey) -> str:
        return f"{self.config.bucket}/{self.name(key)}"

    @property
    def hostname(self) -> str:
        """This instance's segment in the pool."""
        return self.client.hostname

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """Around a call into the client made without the cache's lock: refused (TransferStateError) once
        `close_calls` ran, and waited for by it."""
        with self._users:
            if self._closing:
                raise TransferStateError("the cache is closed: no more calls into the shared pool")
            self._busy += 1
        try:
            yield
        finally:
            with self._users:
                self._busy -= 1
                self._users.notify_all()

    def close_calls(self, timeout: float) -> None:
        """Refuse new `calls` and wait, at most `timeout` seconds, for those under way (before the client closes)."""
        with self._users:
            self._closing = True
            self._users.wait_for(lambda: self._busy == 0, timeout)

    # -- lookups -------------------------------------------------------------
    def held(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, the pool holds (one batched existence check, timed), stopping
        before a chunk whose object is known corrupt."""
        keys = keys[: next((i for i, k in enumerate(keys) if k in self.corrupt), len(keys))]
        if not keys:
            return 0
        t0 = time.perf_counter()
        found = self.client.exists([self.pool_key(k) for k in keys], self.bound_s)
        took = time.perf_counter() - t0
        self._lookup_s.append(took)
        self._check_budget()
        if found and found[0] < 0:
            self._unanswered += 1
            now = time.monotonic()
            if now - self._warned_late_at >= WARN_EVERY_S:
                why = f"within {self.bound_s:.3f} s" if found[0] == -1 else f"({codes.name(int(found[0]))})"
                log.warning(
                    "l4_pool: the pool did not answer an existence check %s (%d unanswered since the last warning;"
                    " a stalled or stopped master?): those chunks count as misses",
                    why, self._unanswered,
                )  # fmt: skip
                self._warned_late_at, self._unanswered = now, 0
        return next((i for i, f in enumerate(found) if f != 1), len(keys))

    def failed_check(self, key: ChunkKey) -> None:
        """`key`'s object failed its CRC32C when read: lookups stop before it until this instance writes it anew."""
        self.corrupt.add(key)

    def rewriting(self, keys: Sequence[ChunkKey]) -> None:
        """This instance is about to write `keys`' objects: the objects of those known corrupt are removed first (a
        write in "keep" mode would leave them), and each one gone is forgotten as corrupt (one the store would
        not remove stays skipped)."""
        marked = [k for k in keys if k in self.corrupt]
        if not marked:
            return
        status = self.client.remove([self.pool_key(k) for k in marked], force=True)
        gone = [k for k, st in zip(marked, status, strict=True) if st in (0, codes.OBJECT_NOT_FOUND)]
        self.corrupt.discard(gone)
        if len(gone) < len(marked):
            log.warning("l4_pool: %d corrupt object(s) could not be removed: still skipped", len(marked) - len(gone))

    def clear(self) -> int:
        """Remove every chunk of this pool (``<bucket>/kv/``), every instance's; how many objects went (the corrupt
        ones among them, no longer skipped)."""
        removed = self.client.remove_prefix(self.prefix)
        if removed < 0:
            raise ObjectStoreError(
                f"removing the pool's objects under {self.prefix!r} failed: {codes.name(removed)}",
                bucket=self.config.bucket, key="kv/", code=codes.token(removed), backend="mooncake",
            )  # fmt: skip
        self.corrupt = CorruptObjects(self.corrupt.limit)
        return removed

    def _check_budget(self) -> None:
        if not self.budget_ms or self._warned or len(self._lookup_s) < 100:
            return
        p99 = float(np.percentile(self._lookup_s, 99)) * 1e3
        if p99 > self.budget_ms:
            self._warned = True
            log.warning("l4_pool: p99 of pool lookups is %.3f ms, over the %.3f ms budget", p99, self.budget_ms)

    def latency(self) -> dict[str, Any]:
        """p50/p99 of the last pool lookups (microseconds) against the budget."""
        s = np.asarray(self._lookup_s) * 1e6
        out: dict[str, Any] = {"lookups": int(s.size), "budget_ms": self.budget_ms or None}
        if s.size:
            out["p50_us"] = float(np.percentile(s, 50))
            out["p99_us"] = float(np.percentile(s, 99))
            if self.budget_ms:
                out["within_budget"] = out["p99_us"] <= self.budget_ms * 1e3
        return out

    # -- drain ---------------------------------------------------------------
    def admin(self, path: str) -> list[str]:
        """Lines of the master's admin endpoint ``path``, bounded; [] without one."""
        url = self.config.master_admin_url
        if not url:
            return []
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=10) as resp:
            body = resp.read(ADMIN_LIMIT + 1)
        if len(body) > ADMIN_LIMIT:
            raise ValueError(f"l4_pool: the master's {path} answered more than {ADMIN_LIMIT} bytes")
        return [line for line in body.decode(errors="replace").splitlines() if line]

    def segments(self) -> list[str]:
        """Other members' segments: the master's list, else the holders seen in replica descriptors."""
        listed = self.admin("/get_all_segments")
        return [s for s in listed if s != self.hostname]

    def unique(self, names: Sequence[str]) -> tuple[list[str], set[str]]:
        """Of pool keys ``names``, those whose every replica is in this instance's memory; and other holders seen."""
        mine, others = [], set()
        for lo in range(0, len(names), 1024):
            for key, holders in self.client.replicas(list(names[lo : lo + 1024])).items():
                if holders and all(h == self.hostname for h in holders):
                    mine.append(key)
                others.update(h for h in holders if h != self.hostname)
        return mine, others

    def drain(self, known: Sequence[ChunkKey], timeout: float | None = None) -> dict[str, int]:
        """Copy every chunk held only in this instance's memory to another member; returns counts.

        The candidates are the chunks this instance knows (``known``) and, with ``master_admin_url``, every
        key of this cache's namespace the master lists. The pool keeps serving every chunk meanwhile: the
        copies are Mooncake copy tasks (the members run them, 16 per client per poll second), and the source
        replica stays until the instance leaves. Progress is read from the replicas themselves, one batched
        call per round; ``timeout`` (default: 30 s plus 0.2 s a chunk) bounds the wait.
        """
        names = {self.pool_key(k) for k in known}
        names.update(k for k in self.admin("/get_all_keys") if k.startswith(self.prefix))
        mine, seen = self.unique(sorted(names))
        targets = self.segments() or sorted(seen)
        out = {"candidates": len(names), "unique": len(mine), "copied": 0, "failed": 0}
        if not mine:
            return out
        if not targets:
            raise RuntimeError("l4_pool: drain found no other member of the pool to copy this instance's chunks to")
        tasks = {}
        for i, key in enumerate(mine):
            task, rc = self.client.copy_to(key, [targets[i % len(targets)]])
            if rc != 0:
                log.warning("l4_pool: drain could not start copying %s (status %d)", key, rc)
                out["failed"] += 1
            else:
                tasks[key] = task
        deadline = time.monotonic() + (30.0 + 0.2 * len(tasks) if timeout is None else timeout)
        pending = sorted(tasks)
        while pending:
            holders = self.client.replicas(pending)
            left = [k for k in pending if not any(h != self.hostname for h in holders.get(k, ()))]
            out["copied"] += len(pending) - len(left)
            pending = left
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for key in pending:
            log.warning("l4_pool: drain copy of %s ended %s", key, self.client.task_state(tasks[key]))
        out["failed"] += len(pending)
        return out
