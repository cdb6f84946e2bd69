"""vLLM's OffloadingConnector with the engine's load-failure contract: failed loads become blocks to recompute.

vLLM 0.32's OffloadingConnector treats any failed transfer as impossible (it asserts, ending the worker). This
subclass changes only that: a datamover load that fails or times out is reported finished, and the GPU blocks it
did not fill go to vLLM as load errors (one KV cache group), or its request as a failed receive (several groups,
whose block ids vLLM cannot map back to requests), which vLLM's scheduler recomputes
(`kv_load_failure_policy: "recompute"`) or fails the request with (`"fail"`, vLLM's default). Use it as
`kv_connector: "DatamoverOffloadingConnector"` with `kv_connector_module_path: "datamover.integrations.vllm"`;
everything else is vLLM's.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .manager import DatamoverOffloadingManager
from .worker import DatamoverOffloadingWorker


class DatamoverOffloadingConnector(OffloadingConnector):
    """OffloadingConnector whose datamover worker reports failed loads as invalid blocks."""

    def _datamover_worker(self) -> DatamoverOffloadingWorker | None:
        cw = self.connector_worker
        worker = cw.worker if cw is not None else None
        return worker if isinstance(worker, DatamoverOffloadingWorker) else None

    def register_kv_caches(self, kv_caches):  # type: ignore[no-untyped-def]
        super().register_kv_caches(kv_caches)
        worker = self._datamover_worker()
        if worker is not None:  # vLLM maps invalid block ids back to requests only with one KV cache group
            worker.report_load_errors = True
            worker.report_block_errors = len(self._kv_cache_config.kv_cache_groups) == 1

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._datamover_worker()
        cw = self.connector_worker
        # the request of each load job, read before vLLM's get_finished forgets the jobs that finished
        loads = dict(getattr(cw, "_load_jobs", {})) if worker is not None else {}
        results = super().get_transfer_results(finished_req_ids)
        if worker is not None:
            failed = {loads[j] for j in worker.take_failed_jobs() if j in loads}
            results.failed_recving |= failed
            results.finished_recving |= failed
        return results

    def reset_cache(self) -> bool | None:
        """vLLM's reset, told whether every worker's tiers forgot their chunks (False: some worker could not)."""
        done = super().reset_cache()
        cs = self.connector_scheduler
        manager = getattr(cs, "manager", None)
        if isinstance(manager, DatamoverOffloadingManager) and manager.reset_failed:
            return False
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._datamover_worker()
        return worker.take_invalid_block_ids() if worker is not None else set()


__all__ = ["DatamoverOffloadingConnector"]
