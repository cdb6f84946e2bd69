"""What the GPU backends do on any machine: lazy imports, exact unavailability reasons, config, pool accounting."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from datamover import Agent, DescList, MemType
from datamover.backends import BUILTIN, backend_status
from datamover.backends.cuda import backend as cuda_mod
from datamover.backends.cuda.backend import CudaBackend, PinnedPool, driver_missing
from datamover.backends.gds import backend as gds_mod
from datamover.backends.gds.backend import DeviceBytes, GdsBackend
from datamover.bench.gpu import check_targets
from datamover.errors import CudaError, DatamoverError, NotRegistered, PinnedPoolExhausted, UnsupportedTransfer
from datamover.units import parse_size

HEAVY = ("cuda.bindings", "cuda.core", "kvikio", "torch", "cupy")

_LOADED = """
import sys
before = set(sys.modules)
{imports}
heavy = sorted(m for m in set(sys.modules) - before if m.startswith({heavy!r}))
print(repr(heavy))
"""


def _new_heavy_modules(imports: str) -> list[str]:
    code = _LOADED.format(imports=imports, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return eval(out.strip().splitlines()[-1])


def test_import_datamover_loads_no_gpu_library():
    assert _new_heavy_modules("import datamover") == []


def test_gpu_backend_modules_load_no_gpu_library():
    imports = "import datamover.backends.cuda, datamover.backends.gds, datamover.bench.gpu"
    assert _new_heavy_modules(imports) == []


@pytest.mark.skipif(driver_missing() is None, reason="a CUDA driver is present here")
def test_info_without_driver_loads_no_gpu_library():
    imports = "from datamover.cli import main; main(['info'])"
    assert _new_heavy_modules(imports) == []


def _info_rows() -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "datamover.cli", "info", "--json"], capture_output=True, text=True, check=True
    ).stdout
    return {r["backend"]: r for r in json.loads(out)["backends"]}


def test_info_reports_the_backends_own_reason():
    rows = _info_rows()
    for name, cls in (("cuda", CudaBackend), ("gds", GdsBackend)):
        ok, reason = cls.available()
        assert rows[name]["usable"] is ok
        assert rows[name]["reason"] == reason
        assert rows[name]["scope"] == ["local"]
    assert rows["cuda"]["moves"] == ["DRAM<->VRAM", "VRAM<->DRAM", "VRAM<->VRAM"]
    assert rows["gds"]["moves"] == ["DRAM<->FILE", "VRAM<->FILE"]


@pytest.mark.skipif(driver_missing() is None, reason="a CUDA driver is present here")
def test_reasons_without_driver_are_exact():
    assert CudaBackend.available() == (False, "no CUDA driver: libcuda.so.1 not found")
    ok, reason = GdsBackend.available()
    assert not ok
    assert reason.startswith(("kvikio is not installed", "kvikio needs libcuda"))
    assert reason.endswith("no CUDA driver: libcuda.so.1 not found")
    text = subprocess.run([sys.executable, "-m", "datamover.cli", "info"], capture_output=True, text=True).stdout
    assert "no CUDA driver: libcuda.so.1 not found" in text


@pytest.mark.skipif(backend_status("cuda")[0], reason="the cuda backend is usable here")
def test_agent_names_why_cuda_cannot_move_vram():
    host = np.zeros(4096, dtype=np.uint8)
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        # raw device pointers with a device id register without touching the memory
        agent.register_memory(DescList.from_columns(0x7F0000000000, 4096, 1, "VRAM"))
        agent.register_memory(host)
        with pytest.raises(UnsupportedTransfer) as info:
            agent.transfer("READ", DescList.from_columns(0x7F0000000000, 4096, 1, "VRAM"), host)
    assert backend_status("cuda")[1] in str(info.value)


def test_raw_device_pointers_are_checked_per_device():
    with Agent("a", {"backends": {}}) as agent:
        agent.register_memory(DescList.from_columns(0x7F0000000000, 1 << 20, 1, "VRAM"))
        prepared = agent.prepare(DescList.from_columns(0x7F0000000000 + np.arange(4) * 4096, 4096, 1, "VRAM"))
        assert len(prepared) == 4
        with pytest.raises(NotRegistered) as info:
            agent.prepare(DescList.from_columns([0x7F0000000000, 0x7F0000000000], 4096, [1, 0], "VRAM"))
        assert info.value.index == 1


def test_pairs_let_the_agent_choose():
    V, D, F = MemType.VRAM, MemType.DRAM, MemType.FILE
    assert all(CudaBackend.moves(a, b, False) for a, b in ((V, D), (D, V), (V, V)))
    assert not CudaBackend.moves(V, D, True), "peers are the ucx backend's"
    assert not CudaBackend.moves(D, D, False) and not CudaBackend.moves(V, F, False)
    assert GdsBackend.moves(V, F, False) and GdsBackend.moves(D, F, False)
    assert not GdsBackend.moves(F, V, False)
    order = list(BUILTIN)
    assert order.index("posix") < order.index("gds"), "DRAM <-> FILE prefers posix unless gds is asked for"


# -- configuration -----------------------------------------------------------------


def test_cuda_params_defaults_and_sizes():
    with Agent("a") as agent:
        b = CudaBackend(agent, {"pinned_pool_bytes": "16G"})
        assert b.pool.limit == 16 << 30 and b.params["batch"] == "auto"
        b.close()
        auto = CudaBackend(agent)
        phys = cuda_mod.physical_memory()
        assert auto.pool.limit == (phys // 2 if phys else None)
        assert CudaBackend(agent, {"pinned_pool_bytes": None}).pool.limit is None
        assert CudaBackend(agent, {"pinned_pool_bytes": 4096}).pool.limit == 4096


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"pinned_pool_bytes": "lots"}, "pinned_pool_bytes"),
        ({"pinned_pool_bytes": -1}, "pinned_pool_bytes"),
        ({"pinned_pool_bytes": True}, "pinned_pool_bytes"),
        ({"batch": "yes"}, "'batch'"),
        ({"batch_chunk": 0}, "batch_chunk"),
        ({"pin_host": "yes"}, "pin_host"),
        ({"streams": 2}, "unknown parameter"),
    ],
)
def test_cuda_params_refused(params, match):
    with Agent("a") as agent, pytest.raises(ValueError, match=match):
        CudaBackend(agent, params)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"threads": 0}, "threads"),
        ({"workers": 1.5}, "workers"),
        ({"task_size": 0}, "task_size"),
        ({"task_size": "big"}, "task_size"),
        ({"compat_mode": "fast"}, "compat_mode"),
        ({"bounce": 1}, "unknown parameter"),
    ],
)
def test_gds_params_refused(params, match):
    with Agent("a") as agent, pytest.raises(ValueError, match=match):
        GdsBackend(agent, params)


def test_gds_params_normalised():
    with Agent("a") as agent:
        b = GdsBackend(agent, {"task_size": "1M", "compat_mode": "ON", "threads": None})
        assert b.params["task_size"] == 1 << 20 and b.params["compat_mode"] == "on" and b.params["threads"] is None
        b.close()


def test_parse_size():
    assert parse_size("4K", "x") == 4096 and parse_size("1.5GiB", "x") == 3 << 29 and parse_size(7, "x") == 7
    with pytest.raises(ValueError, match="x must be"):
        parse_size([1], "x")


# -- pinned pool accounting -----------------------------------------------------------


def test_pinned_pool_limit_and_release():
    pool = PinnedPool(10_000)
    pool.reserve(6_000)
    with pytest.raises(PinnedPoolExhausted) as info:
        pool.reserve(5_000, "DRAM region [0x1000, +5000)")
    err = info.value
    assert isinstance(err, DatamoverError) and isinstance(err, MemoryError) and err.backend == "cuda"
    assert "11000 bytes, over the pinned-pool limit of 10000 bytes (6000 in use)" in str(err)
    assert pool.used == 6_000, "a refused reservation must not count"
    pool.release(6_000)
    pool.reserve(10_000)
    assert pool.used == 10_000
    unlimited = PinnedPool(None)
    unlimited.reserve(1 << 50)
    assert unlimited.used == 1 << 50


def test_pinned_pool_is_exact_under_threads():
    pool = PinnedPool(5_000)
    granted = []

    def grab():
        n = 0
        for _ in range(2_000):
            try:
                pool.reserve(1)
                n += 1
            except PinnedPoolExhausted:
                pass
        granted.append(n)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 5_000 and pool.used == 5_000


# -- CUDA error handling against the real bindings (no driver needed) -----------------


def test_check_raises_typed_error_with_cuda_name():
    rt = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python (cuda.bindings) is not installed")
    E = rt.cudaError_t
    assert cuda_mod.check(rt, (E.cudaSuccess, 5), "f") == 5
    assert cuda_mod.check(rt, (E.cudaSuccess,), "f") is None
    assert cuda_mod.check(rt, (E.cudaSuccess, 1, 2), "f") == (1, 2)
    with pytest.raises(CudaError) as info:
        cuda_mod.check(rt, (E.cudaErrorInvalidValue, None), "cudaMemcpyAsync", index=7)
    err = info.value
    assert err.cuda_error == "cudaErrorInvalidValue" and err.index == 7 and err.backend == "cuda"
    assert str(err) == "backend 'cuda', descriptor 7: cudaMemcpyAsync failed: cudaErrorInvalidValue (invalid argument)"
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert type(again) is CudaError and again.cuda_error == err.cuda_error and again.index == 7


@pytest.mark.skipif(driver_missing() is None, reason="a CUDA driver is present here")
def test_batch_support_probe_without_driver():
    rt = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python (cuda.bindings) is not installed")
    assert cuda_mod._batch_support(rt) == (False, "no CUDA driver")


# -- gds and bench helpers ---------------------------------------------------------------


def test_device_bytes_interface():
    iface = DeviceBytes(0x7F0000001000, 4096).__cuda_array_interface__
    assert iface == {"shape": (4096,), "typestr": "|u1", "data": (0x7F0000001000, False), "strides": None, "version": 3}


def test_configure_kvikio_uses_new_or_old_api():
    calls = []

    class New:
        class defaults:
            @staticmethod
            def set(key, value):
                calls.append(("set", key, value))

            @staticmethod
            def get(key):
                return 1

        class CompatMode:
            ON, OFF, AUTO = "C_ON", "C_OFF", "C_AUTO"

    gds_mod.configure_kvikio(New, 8, "auto")
    assert calls == [("set", "compat_mode", "C_AUTO"), ("set", "num_threads", 8)]
    calls.clear()

    class Old:
        class defaults:
            @staticmethod
            def compat_mode_reset(flag):
                calls.append(("compat", flag))

            @staticmethod
            def get_num_threads():
                return 1

            @staticmethod
            def num_threads_reset(n):
                calls.append(("threads", n))

    gds_mod.configure_kvikio(Old, 4, "on")
    assert calls == [("compat", True), ("threads", 4)]


def test_check_targets():
    rows = [
        {"backend": "cuda", "op": "READ", "block": 4096, "batch": 1, "gbps": 0.1, "raw_gbps": 1.0, "ratio": 0.1},
        {"backend": "cuda", "op": "READ", "block": 1 << 20, "batch": 1, "gbps": 9.5, "raw_gbps": 10.0, "ratio": 0.95},
        {"backend": "cuda", "op": "WRITE", "block": 1 << 24, "batch": 1, "gbps": 8.0, "raw_gbps": 10.0, "ratio": 0.8},
    ]
    lines, ok = check_targets(rows[:2])
    assert ok and "H2D" in lines[1] and lines[1].endswith("ok") and lines[0].endswith("-")
    lines, ok = check_targets(rows)
    assert not ok and lines[2].endswith("BELOW") and "D2H" in lines[2]
    lines, ok = check_targets([{**rows[1], "checked": False}])
    assert not ok and lines[0].endswith("BYTES WRONG")
