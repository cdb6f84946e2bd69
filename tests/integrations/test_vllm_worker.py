"""The vLLM offloading spec's worker and manager on small CPU KV tensors, against vLLM's own classes (no engine):
failed loads of a hybrid model, reset_cache after a weights update, lookups while a transfer runs."""

from __future__ import annotations

import threading
import uuid

import pytest

from datamover.testing.waiting import BOUND_S, HeldOnce, until
from tests.integrations.engine_support import require

require("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from datamover.integrations.vllm.connector import DatamoverOffloadingConnector  # noqa: E402
from datamover.integrations.vllm.service import _LOCAL  # noqa: E402
from datamover.integrations.vllm.spec import DatamoverOffloadingSpec  # noqa: E402
from datamover.integrations.vllm.worker import DatamoverChunks  # noqa: E402

BLOCKS, PAGE, LAYERS = 8, 4096, 2


@pytest.fixture
def offload(tmp_path):
    """(spec, worker, manager, KV tensors) factory: `groups` KV cache groups of LAYERS layers each."""
    made = []

    def make(groups: int = 1):
        config = OffloadingConfig(
            groups=tuple(
                OffloadingGroupConfig(16, tuple(f"g{g}l{i}" for i in range(LAYERS)), g) for g in range(groups)
            ),
            worker_kv_bytes_per_block=PAGE * LAYERS * groups,
            enable_kv_cache_events=False,
            extra_config={
                "spec_name": "DatamoverOffloadingSpec",
                "kv_cache_tiered": {"l2_dram": {"pinned_pool_gb": 0.01}, "l3_nvme": {"path": str(tmp_path / "l3")}},
            },
            engine_id=f"test-worker-{uuid.uuid4().hex[:8]}",
            model=OffloadingModelConfig("m", "float32"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
            kv_cache_layout="NHD",
        )
        spec = DatamoverOffloadingSpec(config)
        tensors = [torch.zeros(BLOCKS, PAGE, dtype=torch.int8) for _ in range(LAYERS * groups)]
        refs = [[CanonicalKVCacheRef(g * LAYERS + i, PAGE) for i in range(LAYERS)] for g in range(groups)]
        worker = spec.get_worker(CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors], refs))
        made.append(worker)
        return spec, worker, spec.get_manager(), tensors

    yield make
    for worker in made:
        worker.shutdown()


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def blocks(ids: list[int], groups: int = 1) -> GPULoadStoreSpec:
    per = len(ids) // groups
    return GPULoadStoreSpec(ids, group_sizes=[per] * groups, block_indices=[0] * groups)


def finish(worker, job_ids: set[int]) -> list:
    """The worker's results for `job_ids`, once all of them finished."""
    out = []

    def done() -> bool:
        out.extend(worker.get_finished())
        return job_ids <= {r.job_id for r in out}

    until(done, what=f"jobs {sorted(job_ids)} finished")
    return out


def test_a_failed_load_of_a_hybrid_model_is_a_failed_receive_not_an_assertion(offload):
    """Two KV cache groups: vLLM cannot map invalid block ids to requests (its scheduler raises), and its
    offloading connector asserts every job succeeded. The request goes to vLLM as a failed receive instead."""
    spec, worker, manager, _ = offload(groups=2)
    connector = object.__new__(DatamoverOffloadingConnector)
    connector.connector_worker = cw = OffloadingConnectorWorker(spec, None, None)
    connector._connector_metadata = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})
    cw.worker = worker
    worker.report_load_errors, worker.report_block_errors = True, False  # what register_kv_caches sets for 2 groups
    keys = [key(1, 0), key(1, 1)]  # never stored: the tiers lost them
    cw._load_jobs[7] = "req-A"
    assert worker.submit_load(7, manager.prepare_load(keys, ReqContext("req-A")), blocks([2, 3], groups=2))
    until(lambda: worker._jobs[7].done(), what="the load finished")
    results = connector.get_transfer_results(set())
    assert results.failed_recving == {"req-A"} and "req-A" in results.finished_recving
    assert connector.get_block_ids_with_load_errors() == set()  # nothing block-level for several groups
    assert connector.get_transfer_results(set()).failed_recving == set()  # reported once


def test_reset_cache_forgets_every_block_and_pin(offload):
    """vLLM's reset after a weights update: no block stored before may be found or loaded again."""
    _, worker, manager, tensors = offload()
    for t in tensors:
        t[3] = 7  # KV of the old weights
    k = key(1)
    job = manager.prepare_store([k], ReqContext("r")).store_spec
    assert worker.submit_store(1, blocks([3]), job)
    finish(worker, {1})
    ctx = ReqContext("r2")
    assert manager.lookup(k, ctx) == LookupResult.HIT
    manager.prepare_load([k], ctx)  # a load whose completion vLLM drops at reset (its pin stays otherwise)
    assert worker.cache._pins
    manager.reset_cache()
    assert not manager.reset_failed
    assert manager.lookup(k, ctx) == LookupResult.MISS
    assert not worker.cache._pins and not any(worker.cache.engine.resident)


def test_a_lookup_and_a_pin_are_answered_while_a_store_moves_its_bytes(offload):
    """The scheduler asks for every block of every new request, and pins a request's hits for its load: a store
    in flight must hold up neither."""
    _, worker, manager, _ = offload()
    _LOCAL.pop(worker.service.path)  # the scheduler lives in another process: go through the socket
    held = HeldOnce("the store's move")
    run = worker.cache.mover.run
    worker.cache.mover.run = held.wrap(run)
    assert worker.submit_store(1, blocks([1]), DatamoverChunks([key(1)]))
    assert held.reached.wait(BOUND_S)
    answered = []
    asking = threading.Thread(target=lambda: answered.append(manager.lookup(key(99), ReqContext("other"))))
    asking.start()
    asking.join(BOUND_S / 2)
    asked = worker.counters["lookups"]  # the worker answered (a manager that gave up waiting says MISS too)
    pinning = threading.Thread(target=manager.prepare_load, args=([key(99)], ReqContext("other")))
    pinning.start()
    pinning.join(BOUND_S / 2)
    pinned = dict(worker.cache._pins)
    held.go.set()
    assert asked == 1 and answered == [LookupResult.MISS]  # answered while the store was still held
    assert len(pinned) == LAYERS  # the load's pages pinned meanwhile too
    finish(worker, {1})
