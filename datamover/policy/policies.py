"""Eviction and placement policies: which chunks a tier keeps, which it lets go first, and which it admits.

A `Policy` is the shared brain of one cache (it sees every reference once, through `observe`); it hands each
tier a `TierPolicy` that orders that tier's resident chunks. The cache (or the replay simulator) owns the tiers
and asks the tier policy three questions: may this chunk come in (`admit`), which chunks leave (`evict`), and it
reports what happened (`insert`, `touch`, `remove`).

Policies here:
- `lru`: least recently used, the baseline.
- `default`: frequency and recency. A chunk's score is a decayed use count: each use adds 1 and the score halves
  every `half_life_s` unused (LRFU's combined recency-frequency). Scores of evicted chunks are remembered
  (`history_factor`), so a chunk that comes back resumes its score instead of starting over; one-shot chunks
  therefore leave before chunks that were reused, which is what resists scans. A chunk placed or used less than
  the hysteresis cooldown ago is evicted only when nothing else can go. A full tier admits a chunk only if it
  outscores the chunk it would replace.
- `belady`: the offline optimum for one tier (evict the chunk whose next use is furthest; do not admit a chunk
  used later than every resident one). It needs the future, so only the replay can use it.

More policies plug in with `register_policy(name, factory)` or the entry-point group `datamover.policies`.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

import numpy as np

from .config import PolicyConfig, TierConfig

Key = Hashable
NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class PolicySettings:
    """What a policy may be tuned by (from the `policy:` section and l2_dram.hysteresis_cooldown_s)."""

    half_life_s: float = 300.0
    history_factor: float = 8.0
    cooldown_s: float = 5.0
    admission: bool = True

    @classmethod
    def from_config(cls, config: TierConfig) -> PolicySettings:
        """Settings as the tier config gives them."""
        p: PolicyConfig = config.policy
        return cls(p.half_life_s, p.history_factor, config.l2_dram.hysteresis_cooldown_s, p.admission)


class TierPolicy(ABC):
    """Orders the resident chunks of one tier. The owner keeps the chunks; this keeps only their order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        """`key` became resident at time `now` (reference index `ref` in a replay)."""

    @abstractmethod
    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        """Resident `key` was used."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Resident `key` left the tier for a reason of the owner's (not chosen by `evict`)."""

    @abstractmethod
    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        """Choose up to `count` resident chunks to leave, never a pinned one, forget them and return them."""

    @abstractmethod
    def __len__(self) -> int: ...

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        """Whether `key` may replace a resident chunk of this full tier (True: admission control off)."""
        return True


class Policy(ABC):
    """One cache's policy: sees every reference (`observe`) and makes a TierPolicy per tier."""

    name = "policy"

    @abstractmethod
    def tier(self, capacity: int) -> TierPolicy:
        """A fresh TierPolicy for a tier of `capacity` chunks."""

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        """Every reference, once, before the cache looks the key up (default: nothing to learn)."""


class LRUTier(TierPolicy):
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self._order[key] = None

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        del self._order[key]

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        for key in self._order:
            if len(out) == count:
                break
            if key not in pinned:
                out.append(key)
        for key in out:
            del self._order[key]
        return out

    def __len__(self) -> int:
        return len(self._order)


class LRUPolicy(Policy):
    """The baseline: every tier evicts its least recently used chunk, admits everything."""

    name = "lru"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        """LRU takes no settings; the argument keeps every policy constructible the same way."""

    def tier(self, capacity: int) -> TierPolicy:
        return LRUTier(capacity)


class ScoreBook:
    """Decayed use counts of chunks, resident or recently evicted, shared by all tiers of a cache.

    score(t) = sum over uses u of 2^-((t - t_u) / half_life). Between uses every score decays by the same
    factor, so it is stored as the time-invariant log key `log2(score(t)) + t / half_life`: ordering by key is
    ordering by current score, and a heap over keys never needs re-sorting.
    """

    def __init__(self, half_life_s: float, max_entries: int) -> None:
        self.rate = 1.0 / half_life_s
        self.max_entries = max(1, max_entries)
        self._keys: OrderedDict[Key, float] = OrderedDict()

    def record(self, key: Key, now: float) -> float:
        """Count one use of `key` at `now`; return its new log key."""
        base = self.rate * now
        old = self._keys.get(key)
        if old is None:
            new = base
        else:
            e = old - base  # log2 of the decayed score before this use
            new = base + (e + math.log2(1.0 + 2.0**-e) if e > 0 else math.log2(1.0 + 2.0**e))
            self._keys.move_to_end(key)
        self._keys[key] = new
        if len(self._keys) > self.max_entries:
            self._keys.popitem(last=False)
        return new

    def key(self, key: Key, now: float) -> float:
        """The log key of `key` (a chunk never seen counts as one use now)."""
        return self._keys.get(key, self.rate * now)

    def score(self, key: Key, now: float) -> float:
        """The decayed use count of `key` at `now` (0 if unknown)."""
        k = self._keys.get(key)
        return 0.0 if k is None else 2.0 ** (k - self.rate * now)

    def grow(self, entries: int) -> None:
        """Remember `entries` more chunks (a tier was added)."""
        self.max_entries += entries


class ScoredTier(TierPolicy):
    """Evicts the lowest score first, never a chunk in its cooldown while another can go, admits by score.

    A chunk placed or used less than `cooldown_s` ago waits in a FIFO and joins the score heap when its
    cooldown ends, so eviction never scans over cooling chunks. Stale heap and FIFO entries are skipped lazily.
    """

    def __init__(self, capacity: int, book: ScoreBook, settings: PolicySettings) -> None:
        super().__init__(capacity)
        self.book = book
        self.cooldown = settings.cooldown_s
        self.admission = settings.admission
        self._key: dict[Key, float] = {}  # every resident chunk -> its log key
        self._cooling: dict[Key, float] = {}  # chunk in its cooldown -> when it started
        self._fifo: deque[tuple[float, Key]] = deque()  # (start, chunk), oldest first; stale if restarted
        self._live: dict[Key, int] = {}  # chunk in the heap -> sequence number of its valid entry
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = 0
        self._cooled_at = -math.inf

    def _to_heap(self, key: Key) -> None:
        self._seq += 1
        self._live[key] = self._seq
        heapq.heappush(self._heap, (self._key[key], self._seq, key))

    def _place(self, key: Key, now: float) -> None:
        self._key[key] = self.book.key(key, now)
        if self.cooldown > 0:
            self._live.pop(key, None)
            self._cooling[key] = now
            self._fifo.append((now, key))
        else:
            self._to_heap(key)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self._place(key, now)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._place(key, now)

    def remove(self, key: Key) -> None:
        del self._key[key]
        self._cooling.pop(key, None)
        self._live.pop(key, None)

    def _cool_down(self, now: float) -> None:
        """Move chunks whose cooldown has ended from the FIFO into the heap (nothing new ends at the same now)."""
        if now == self._cooled_at:
            return
        self._cooled_at = now
        fifo, cooling, limit = self._fifo, self._cooling, now - self.cooldown
        while fifo and fifo[0][0] <= limit:
            since, key = fifo.popleft()
            if cooling.get(key) == since:
                del cooling[key]
                self._to_heap(key)
        if len(self._heap) > 2 * len(self._live) + 64:  # drop stale entries
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def _valid_top(self) -> tuple[float, int, Key] | None:
        heap, live = self._heap, self._live
        while heap:
            if live.get(heap[0][2]) == heap[0][1]:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _cooling_order(self) -> list[Key]:
        """Chunks still cooling down, the longest-cooling first."""
        return [k for since, k in self._fifo if self._cooling.get(k) == since]

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        if not self.admission:
            return True
        self._cool_down(now)
        top = self._valid_top()
        if top is not None:
            return self.book.key(key, now) >= top[0]
        cooling = self._cooling_order()
        return not cooling or self.book.key(key, now) >= self._key[cooling[0]]

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        self._cool_down(now)
        heap, live, keys = self._heap, self._live, self._key
        out: list[Key] = []
        held: list[tuple[float, int, Key]] = []
        while len(out) < count and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if live.get(key) != entry[1]:  # stale
                continue
            if key in pinned:
                held.append(entry)
                continue
            out.append(key)
            del live[key], keys[key]
        for entry in held:
            heapq.heappush(heap, entry)
        if len(out) < count:  # last resort: chunks still cooling down, the longest-cooling first
            cooling = [k for k in self._cooling_order() if k not in pinned][: count - len(out)]
            for key in cooling:
                self.remove(key)
            out += cooling
        return out

    def __len__(self) -> int:
        return len(self._key)


class DefaultPolicy(Policy):
    """Frequency and recency (decayed use counts with memory), hysteresis cooldown, score-based admission."""

    name = "default"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()
        self.book = ScoreBook(self.settings.half_life_s, 0)

    def tier(self, capacity: int) -> TierPolicy:
        self.book.grow(int((1.0 + self.settings.history_factor) * capacity))
        return ScoredTier(capacity, self.book, self.settings)

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        self.book.record(key, now)


def next_use(ids: np.ndarray) -> np.ndarray:
    """For each reference i of an integer id sequence, the index of the next reference to the same id
    (NEVER if none), in O(n log n) numpy."""
    ids = np.asarray(ids)
    n = len(ids)
    out = np.full(n, NEVER, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


class BeladyTier(TierPolicy):
    """Evicts the chunk used furthest in the future; a max-heap with lazy deletion."""

    def __init__(self, capacity: int, oracle: BeladyPolicy) -> None:
        super().__init__(capacity)
        self.oracle = oracle
        self._next: dict[Key, int] = {}
        self._heap: list[tuple[int, Key]] = []

    def _set(self, key: Key) -> None:
        n = self.oracle.next_of[key]
        self._next[key] = n
        heapq.heappush(self._heap, (-n, key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [(-v, k) for k, v in self._next.items()]
            heapq.heapify(self._heap)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self._set(key)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._set(key)

    def remove(self, key: Key) -> None:
        del self._next[key]

    def _valid_top(self) -> tuple[int, Key] | None:
        heap = self._heap
        while heap:
            neg, key = heap[0]
            if self._next.get(key) == -neg:
                return heap[0]
            heapq.heappop(heap)
        return None

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        top = self._valid_top()
        return top is None or self.oracle.next_of[key] < -top[0]

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        held = []
        while len(out) < count and self._valid_top() is not None:
            entry = heapq.heappop(self._heap)
            if entry[1] in pinned:
                held.append(entry)
            else:
                out.append(entry[1])
                del self._next[entry[1]]
        for entry in held:
            heapq.heappush(self._heap, entry)
        return out

    def __len__(self) -> int:
        return len(self._next)


class BeladyPolicy(Policy):
    """Belady's offline optimum; `next_uses[i]` is the index of the next use of reference i's chunk."""

    name = "belady"

    def __init__(self, next_uses: np.ndarray) -> None:
        self._next_uses = next_uses.tolist()
        self.next_of: dict[Key, int] = {}

    def tier(self, capacity: int) -> TierPolicy:
        return BeladyTier(capacity, self)

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        self.next_of[key] = self._next_uses[ref]


PolicyFactory = Callable[[PolicySettings], Policy]
_REGISTRY: dict[str, PolicyFactory] = {"lru": LRUPolicy, "default": DefaultPolicy}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make `factory(settings) -> Policy` available as policy `name` (config `policy.name`, replay --policy)."""
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    """Registered online policies (built-in and from the `datamover.policies` entry-point group)."""
    _load_plugins()
    return sorted(_REGISTRY)


def make_policy(name: str, settings: PolicySettings | None = None) -> Policy:
    """A fresh online policy by name; KeyError names the registered ones."""
    _load_plugins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](settings or PolicySettings())


_plugins_loaded = False


def _load_plugins() -> None:
    """Register the `datamover.policies` entry points once (built-in and explicit registrations win)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group="datamover.policies"):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


def belady_hits(ids: Sequence[int] | np.ndarray, capacity: int) -> int:
    """Hits of Belady's optimum (with bypass) on one tier of `capacity` chunks: the bound for any policy."""
    ids = np.asarray(ids, dtype=np.int64)
    if capacity <= 0:
        return 0
    nxt = next_use(ids).tolist()
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, key in enumerate(ids.tolist()):
        n = nxt[i]
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while resident.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if n >= -heap[0][0]:
                continue
            del resident[heapq.heappop(heap)[1]]
        resident[key] = n
        heapq.heappush(heap, (-n, key))
        if len(heap) > 4 * capacity + 64:
            heap = [(-v, k) for k, v in resident.items()]
            heapq.heapify(heap)
    return hits
