"""The policies' fast paths take exactly the steps of the slow code they replace: `TierPolicy.ref` (a shadow
cache's reference) against the generic admit/evict/insert sequence, `evict_avoiding` against the loop of
`evict(1)` and `restore` it stands for. Random sequences with repeats, pins and parents; same answers and same
state after every step, so a fast path that drifts from its policy fails here."""

from __future__ import annotations

import copy
import heapq
import random

import pytest

from datamover.policy.arc import ARCTier
from datamover.policy.base import Policy, TierPolicy
from datamover.policy.engine import TierSpec, TierStack
from datamover.policy.lecar import LeCaRTier
from datamover.policy.lfu import LFUTier
from datamover.policy.lru import LRUTier
from datamover.policy.policies import make_policy
from datamover.policy.s3fifo import S3FIFOTier
from datamover.policy.tinylfu import FrequencySketch, WTinyLFUTier

EXPERTS = {
    "s3fifo": lambda c: S3FIFOTier(c),
    "wtinylfu": lambda c: WTinyLFUTier(c, FrequencySketch(64)),
    "wtinylfu-wide": lambda c: WTinyLFUTier(c, FrequencySketch(64), window_ratio=0.3),  # runs of refusals
    "arc": lambda c: ARCTier(c),
    "lru": lambda c: LRUTier(c),
    "lfu": lambda c: LFUTier(c),
}


def state(t: TierPolicy):
    """Everything a policy decides by, as plain values (orders included)."""
    out = {}
    for name, value in vars(t).items():
        if name in ("sketch", "rng"):
            continue
        out[name] = list(value.items()) if isinstance(value, dict) else value
    if isinstance(t, LFUTier):  # the heap of priorities is lazy: what counts is which live groups it reaches
        assert set(t._groups) <= set(t._heap)
        out["_heap"] = sorted(set(t._heap) & set(t._groups))
        for name in ("_count", "_prio", "_groups"):  # looked up by key: their own order decides nothing
            out[name] = dict(getattr(t, name))  # (each group is an OrderedDict: its order is compared)
    if isinstance(t, WTinyLFUTier):
        out["sketch"] = sorted(t.sketch.counts.items())
    return out


def slow_ref(t: TierPolicy, resident: set, key, now: float) -> bool:
    """A shadow reference the long way: what the default's shadow caches did before `ref`."""
    if key in resident:
        t.touch(key, now)
        return True
    if len(resident) >= t.capacity:
        if not t.admit(key, now):
            return False
        for victim in t.evict(len(resident) + 1 - t.capacity, now):
            resident.discard(victim)
    resident.add(key)
    t.insert(key, now)
    return False


@pytest.mark.parametrize("name", sorted(EXPERTS))
@pytest.mark.parametrize("capacity", [1, 3, 17])
def test_ref_is_the_generic_shadow_reference(name, capacity):
    rng = random.Random(capacity)
    fast, slow = EXPERTS[name](capacity), EXPERTS[name](capacity)
    resident: set = set()
    hits = 0
    for i in range(3000):
        key = int(rng.paretovariate(1.0)) % (4 * capacity + 5)
        for t in (fast, slow):
            if isinstance(t, WTinyLFUTier):
                t.sketch.add(key)
        got = fast.ref(key, float(i))
        assert got == slow_ref(slow, resident, key, float(i)), i
        assert state(fast) == state(slow), i
        assert len(fast) == len(resident) <= capacity
        hits += got
    assert 0 < hits < 3000


@pytest.mark.parametrize("name", sorted(EXPERTS))
@pytest.mark.parametrize("capacity", [1, 3, 17])
def test_ref_request_is_ref_in_the_served_order(name, capacity):
    """A shadow's request at once (`ref_request`) takes the steps of `ref` for each chunk in the order the
    engine would hand the request to a tier holding what the shadow holds (`TierPolicy.ref_request`, the
    generic loop): the same hits and the same state after each request, repeats within a request included."""
    rng = random.Random(capacity + 3)
    fast, slow = EXPERTS[name](capacity), EXPERTS[name](capacity)
    hits = 0
    for i, keys in enumerate(random_requests(capacity, 1500)):
        keys = [k % (6 * capacity + 5) for k in keys] if rng.random() < 0.5 else keys
        for t in (fast, slow):
            if isinstance(t, WTinyLFUTier):
                for key in keys:
                    t.sketch.add(key)
        got = fast.ref_request(keys, float(i))
        assert sorted(got) == sorted(TierPolicy.ref_request(slow, keys, float(i))), i
        assert state(fast) == state(slow), i
        hits += len(got)
    assert hits > 100


def slow_evict_avoiding(t: TierPolicy, avoid, tries: int, now: float, pinned):
    """The default's leaf guard as it was written: evict one, hand it back while it is avoided."""
    got = t.evict(1, now, pinned)
    for _ in range(tries):
        if not got or got[0] not in avoid:
            break
        t.restore(got[0], now)
        got = t.evict(1, now, pinned)
    return got[0] if got else None


@pytest.mark.parametrize("name", [*sorted(EXPERTS), "lecar"])
@pytest.mark.parametrize("capacity", [2, 9, 120])
def test_evict_avoiding_takes_the_steps_of_the_hand_back_loop(name, capacity):
    rng = random.Random(capacity + 7)
    make = EXPERTS.get(name, lambda c: LeCaRTier(c, seed=1))
    fast = make(capacity)
    resident: set = set()
    checked = 0
    for i in range(4000):
        key = int(rng.paretovariate(0.8)) % (5 * capacity + 9)
        if isinstance(fast, WTinyLFUTier):
            fast.sketch.add(key)
        if key in resident:
            fast.touch(key, float(i))
            continue
        if len(resident) >= capacity:
            fast.admit(key, float(i))
            slow = copy.deepcopy(fast)
            keys = list(resident)
            avoid = set(rng.sample(keys, rng.randrange(len(keys) + 1)))  # up to all of them
            pinned = set(rng.sample(keys, rng.randrange(min(3, len(keys)) + 1))) if rng.random() < 0.3 else ()
            tries = rng.choice([0, 1, 3, 8, 40])
            got = fast.evict_avoiding(avoid, tries, float(i), pinned)
            assert got == slow_evict_avoiding(slow, avoid, tries, float(i), pinned), i
            assert state(fast) == state(slow), i
            checked += got is not None and got in avoid
            if got is not None:
                resident.discard(got)
        resident.add(key)
        fast.insert(key, float(i))
    assert checked  # some victims were avoided chunks taken anyway (tries ran out)


@pytest.mark.parametrize("name", [*sorted(EXPERTS), "lecar"])
def test_evicting_without_pins_is_evicting_with_a_pin_on_nothing(name):
    """`evict` may skip its pin bookkeeping when nothing is pinned (LFU-DA does): a pin on a key that is not
    resident must leave every choice the same as no pin at all."""
    rng = random.Random(5)
    make = EXPERTS.get(name, lambda c: LeCaRTier(c, seed=1))
    plain, pinned = make(40), make(40)
    resident: set = set()
    for i in range(3000):
        key = int(rng.paretovariate(0.9)) % 150
        for t in (plain, pinned):
            if isinstance(t, WTinyLFUTier):
                t.sketch.add(key)
        if key in resident:
            plain.touch(key, float(i))
            pinned.touch(key, float(i))
            continue
        if len(resident) >= 40:
            count = rng.choice([1, 1, 1, 3])
            got = plain.evict(count, float(i))
            assert got == pinned.evict(count, float(i), {-1}), i
            resident.difference_update(got)
        resident.add(key)
        plain.insert(key, float(i))
        pinned.insert(key, float(i))
        assert state(plain) == state(pinned), i


class HeapLFUDA:
    """LFU-DA as the textbook writes it (and as `LFUTier` was): a lazy min-heap of (priority, sequence, key),
    one entry per use, stale entries skipped; the reference the grouped `LFUTier` must match step for step."""

    def __init__(self) -> None:
        self.age, self.count, self.entry, self.heap, self.seq = 0.0, {}, {}, [], 0

    def push(self, key, count: int) -> None:
        self.count[key] = count
        self.seq += 1
        self.entry[key] = (self.age + count, self.seq, key)
        heapq.heappush(self.heap, self.entry[key])

    def remove(self, key) -> None:
        del self.count[key], self.entry[key]

    def evict(self, count: int, pinned) -> list:
        out, held = [], []
        while len(out) < count and self.heap:
            entry = heapq.heappop(self.heap)
            key = entry[2]
            if self.entry.get(key) is not entry:
                continue
            if key in pinned:
                held.append(entry)
                continue
            self.age = entry[0]
            self.remove(key)
            out.append(key)
        for entry in held:
            heapq.heappush(self.heap, entry)
        return out


@pytest.mark.parametrize("capacity", [1, 4, 60])
def test_grouped_lfu_da_evicts_as_the_lazy_heap_does(capacity):
    """Random inserts, uses, removals, evictions of 1-4 chunks with and without pins, adoption: the grouped
    LFU-DA picks the same victims in the same order, and keeps the same age, counts and priorities."""
    rng = random.Random(capacity * 31 + 1)
    fast, ref = LFUTier(capacity), HeapLFUDA()
    resident: list = []
    evicted = 0
    for i in range(6000):
        key = int(rng.paretovariate(0.9)) % (6 * capacity + 7)
        if i == 3000:  # a policy switch hands a new instance the resident chunks with counts
            counts = {k: rng.randrange(0, 6) for k in resident}
            fast = LFUTier(capacity)
            fast.adopt(list(resident), counts)
            ref = HeapLFUDA()
            for k in resident:
                ref.push(k, max(1, counts.get(k, 1)))
        if fast.holds(key):
            if rng.random() < 0.1:
                fast.remove(key)
                ref.remove(key)
                resident.remove(key)
            else:
                fast.touch(key, float(i))
                ref.push(key, ref.count[key] + 1)
        else:
            if len(resident) >= capacity:
                count = rng.choice([1, 1, 1, 2, 4])
                pinned = set(rng.sample(resident, min(len(resident), rng.randrange(3)))) if rng.random() < 0.3 else ()
                got = fast.evict(count, float(i), pinned)
                assert got == ref.evict(count, pinned), i
                evicted += len(got)
                for k in got:
                    resident.remove(k)
            fast.insert(key, float(i))
            ref.push(key, 1)
            resident.append(key)
        assert fast.age == ref.age, i
        assert fast._count == ref.count, i
        assert {k: fast.priority(k) for k in resident} == {k: e[0] for k, e in ref.entry.items()}, i
    assert evicted > 100


class HookedStack(TierStack):
    """A stack whose placement hook is overridden (as the runtime's is): it takes the general request path."""

    def _placed(self, source: str, j: int, key) -> None:
        pass


def random_requests(seed: int, n: int) -> list[list[int]]:
    """Prefix chains as a KV cache sees them: shared heads (system prompts), growing sessions, fresh tails,
    now and then a key repeated within one request."""
    rng = random.Random(seed)
    heads = [[rng.randrange(10**6) for _ in range(rng.randrange(1, 6))] for _ in range(6)]
    sessions: list[list[int]] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4 and sessions:
            s = rng.choice(sessions)
            s.extend(rng.randrange(10**6) for _ in range(rng.randrange(1, 4)))
            req = list(s)
        elif r < 0.8:
            req = rng.choice(heads) + [rng.randrange(10**6) for _ in range(rng.randrange(0, 8))]
            sessions.append(list(req))
        else:
            req = [rng.randrange(10**6) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.05 and len(req) > 2:
            req.insert(rng.randrange(1, len(req)), req[0])
        out.append(req)
    return out


class PickyLRU(LRUTier):
    """LRU that refuses every third key into a full tier (a policy with admission control)."""

    def admit(self, key, now: float, ref: int = -1) -> bool:
        return key % 3 != 0


class PickyLRUPolicy(Policy):
    def tier(self, capacity: int) -> TierPolicy:
        return PickyLRU(capacity)


@pytest.mark.parametrize("leaf_first", [True, False])
@pytest.mark.parametrize("policy", ["default", "lru", "lfu", "arc", "s3fifo", "wtinylfu", "lecar", "scored", "picky"])
def test_one_tier_request_path_is_the_general_path(policy, leaf_first):
    """`TierStack.access_request` on one plain tier takes a short path: the same usable prefixes, hits, misses,
    evictions, moves and resident chunks as the general path after every request, with watermarks below 1
    (batch eviction), chunks pinned from outside, and a policy that refuses admission."""
    make = PickyLRUPolicy if policy == "picky" else lambda: make_policy(policy)
    for capacity, low in ((7, 1.0), (40, 0.75)):
        fast = TierStack(make(), [TierSpec("l1_hbm", capacity, 1.0, low)])
        slow = HookedStack(make(), [TierSpec("l1_hbm", capacity, 1.0, low)])
        assert fast._plain and not slow._plain
        for i, keys in enumerate(random_requests(capacity, 1500)):
            if i % 97 == 0:  # a chunk held by a caller stays whatever the policy says
                for s in (fast, slow):
                    s.pinned.clear()
                    s.pinned.update(sorted(fast.resident[0])[:2])
            got = fast.access_request(keys, float(i), 10 * i, leaf_first)
            assert got == slow.access_request(keys, float(i), 10 * i, leaf_first), i
            assert (fast.hits, fast.misses, fast.evictions) == (slow.hits, slow.misses, slow.evictions), i
            assert fast.moved == slow.moved and fast.resident == slow.resident, i
        assert fast.evictions[0] > 100 and fast.hits[0] > 100


@pytest.mark.parametrize("capacity", [1, 5, 50])
def test_lecar_lfu_victim_is_the_least_used_longest_ago(capacity):
    """LeCaR's LFU expert (use counts grouped, a heap of the counts in use) proposes the unpinned chunk with
    the fewest uses and, among equals, the oldest last use (the clock of its last push), by brute force."""
    rng = random.Random(capacity + 3)
    t = LeCaRTier(capacity, seed=2)
    last_use: dict = {}
    checked = 0
    for i in range(5000):
        key = int(rng.paretovariate(0.8)) % (5 * capacity + 7)
        if key in t._freq:
            t.touch(key, float(i))
        else:
            if len(t) >= capacity:
                residents = list(t._freq)
                pinned = set(rng.sample(residents, rng.randrange(len(residents) + 1))) if rng.random() < 0.3 else ()
                free = [k for k in residents if k not in pinned]
                want = min(free, key=lambda k: (t._freq[k], last_use[k])) if free else None
                assert t._lfu_victim(pinned) == want, i
                checked += 1
                for gone in t.evict(1, float(i), pinned):
                    del last_use[gone]
                if len(t) >= capacity:
                    continue
            t.insert(key, float(i))
        last_use[key] = t.clock
    assert checked > 200
