"""NIXL's telemetry names: per-transfer fields, the shared-memory event ring NIXL's readers open, Prometheus names."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
import pytest

from datamover.compat import nixl as nx
from datamover.compat.nixl import nixl_agent, nixl_agent_config
from datamover.compat.nixl._telemetry import EVENT_NAMES, TELEMETRY_VERSION

BUF = 8192


def read_ring(path: str) -> list[tuple[str, int]]:
    """Events of NIXL's cyclic buffer file, decoded from its layout (as telemetry_reader.py does)."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        write_pos, read_pos, version, expected, capacity, mask = struct.unpack_from("=QQiiQQ", m, 0)
        assert version == expected == TELEMETRY_VERSION and mask == capacity - 1
        out = []
        while read_pos != write_pos:
            etype, value = struct.unpack_from("=I4xQ", m, 40 + 16 * read_pos)
            out.append((EVENT_NAMES[etype], value))
            read_pos = (read_pos + 1) & mask
        return out


def loopback_write(agent: nixl_agent) -> nx.nixl_xfer_handle:
    src = np.arange(BUF, dtype=np.uint8)
    dst = np.zeros(BUF, dtype=np.uint8)
    agent._keep = (src, dst)
    agent.register_memory([(src.ctypes.data, BUF, 0, ""), (dst.ctypes.data, BUF, 0, "")], "DRAM")
    h = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([(src.ctypes.data, BUF, 0)], "DRAM"),
        agent.get_xfer_descs([(dst.ctypes.data, BUF, 0)], "DRAM"),
        agent.name,
    )
    agent.transfer(h)
    while agent.check_xfer_state(h) == "PROC":
        pass
    assert agent.check_xfer_state(h) == "DONE" and (dst == src).all()
    return h


@pytest.fixture
def no_telemetry_env(monkeypatch):
    for var in ("NIXL_TELEMETRY_ENABLE", "NIXL_TELEMETRY_DIR", "NIXL_TELEMETRY_EXPORTER"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_ring_buffer_file_has_nixl_events(no_telemetry_env, tmp_path):
    no_telemetry_env.setenv("NIXL_TELEMETRY_ENABLE", "y")
    no_telemetry_env.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    no_telemetry_env.setenv("NIXL_TELEMETRY_BUFFER_SIZE", "64")
    with nixl_agent("ringer", nixl_agent_config(backends=[])) as agent:
        h = loopback_write(agent)
        t = agent.get_xfer_telemetry(h)
        events = read_ring(os.path.join(tmp_path, "ringer"))
    names = [n for n, _ in events]
    assert ("agent_memory_registered", 2 * BUF) in events
    assert ("agent_tx_bytes", BUF) in events and ("agent_tx_requests_num", 1) in events
    assert dict(events)["agent_xfer_time"] == t.xferDuration and dict(events)["agent_xfer_post_time"] == t.postDuration
    assert names.count("agent_tx_bytes") == 1  # one event per finished post, however often its state is polled
    assert (t.totalBytes, t.descCount) == (BUF, 1) and 0 < t.postDuration <= t.xferDuration


def test_ring_buffer_drops_when_the_reader_is_behind(tmp_path):
    ring = nx._telemetry.RingBufferFile(str(tmp_path / "r"), 4)
    assert [ring.push(0, v) for v in range(4)] == [True, True, True, False]  # one slot stays free, as NIXL's
    assert ring.dropped == 1
    with pytest.raises(ValueError):
        nx._telemetry.RingBufferFile(str(tmp_path / "s"), 6)


def test_env_decides_over_capture_telemetry_as_in_nixl(no_telemetry_env):
    no_telemetry_env.setenv("NIXL_TELEMETRY_ENABLE", "no")
    with nixl_agent("off", nixl_agent_config(backends=[], capture_telemetry=True)) as agent:
        with pytest.raises(nx.nixlNoTelemetryError):
            agent.get_xfer_telemetry(loopback_write(agent))
    no_telemetry_env.delenv("NIXL_TELEMETRY_ENABLE")
    with nixl_agent("on", nixl_agent_config(backends=[], capture_telemetry=True)) as agent:
        assert agent.get_xfer_telemetry(loopback_write(agent)).totalBytes == BUF
    with nixl_agent("unset", nixl_agent_config(backends=[])) as agent:
        with pytest.raises(nx.nixlNoTelemetryError):
            agent.get_xfer_telemetry(loopback_write(agent))


def test_prometheus_names_are_nixls(no_telemetry_env):
    from prometheus_client import CollectorRegistry, generate_latest

    with nixl_agent("prom", nixl_agent_config(backends=[], capture_telemetry=True)) as agent:
        loopback_write(agent)
        with pytest.raises(nx.nixlNotPostedError):
            agent.check_xfer_state(
                agent.initialize_xfer("READ", nx.nixlXferDList(nx.DRAM_SEG), nx.nixlXferDList(nx.DRAM_SEG), "prom")
            )
        registry = CollectorRegistry()
        registry.register(agent.agent.events.collector())
        text = generate_latest(registry).decode()
    lines = {ln.split("{")[0]: ln for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert lines["agent_tx_bytes_total"].endswith(f" {float(BUF)}")
    assert lines["agent_tx_last_bytes"].endswith(f" {float(BUF)}")
    assert lines["agent_memory_registered_total"].endswith(f" {float(2 * BUF)}")
    for name in ("agent_rx_bytes_total", "agent_xfer_time_total", "agent_xfer_time", "agent_xfer_post_time_total",
                 "agent_xfer_time_us_bucket", "agent_xfer_post_time_us_count", "agent_errors_total"):  # fmt: skip
        assert name in lines, name
    assert 'agent_name="prom"' in lines["agent_tx_bytes_total"]
    assert 'status="not_posted"' in text and "agent_errors_total" in text


@pytest.mark.parametrize(
    ("env", "var", "said"),
    [
        ({"NIXL_TELEMETRY_BUFFER_SIZE": "abc"}, "NIXL_TELEMETRY_BUFFER_SIZE", "expected an integer"),  # int()'s
        ({"NIXL_TELEMETRY_BUFFER_SIZE": "-4"}, "NIXL_TELEMETRY_BUFFER_SIZE", "expected an integer"),
        ({"NIXL_TELEMETRY_BUFFER_SIZE": "3"}, "NIXL_TELEMETRY_BUFFER_SIZE", "must be a power of 2"),
        ({"NIXL_TELEMETRY_BUFFER_SIZE": str(1 << 41)}, "NIXL_TELEMETRY_BUFFER_SIZE", "expected an integer from 0"),
        ({"NIXL_TELEMETRY_DIR": "/nonexistent/dir"}, "NIXL_TELEMETRY_DIR", "No such file or directory"),
        (
            {"NIXL_TELEMETRY_EXPORTER": "prometheus", "NIXL_TELEMETRY_PROMETHEUS_PORT": "99999"},
            "NIXL_TELEMETRY_PROMETHEUS_PORT",  # bind()'s OverflowError
            "expected an integer from 0 to 65535",
        ),
        (
            {"NIXL_TELEMETRY_EXPORTER": "prometheus", "NIXL_TELEMETRY_PROMETHEUS_PORT": "http"},
            "NIXL_TELEMETRY_PROMETHEUS_PORT",
            "expected an integer",
        ),
        ({"NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US": "1,,2"}, "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "increasing finite"),
        ({"NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US": "nan"}, "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "increasing finite"),
        ({"NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US": "1,inf"}, "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "increasing finite"),
    ],
)
def test_a_bad_telemetry_variable_is_named(no_telemetry_env, tmp_path, env, var, said):
    """Each was a bare ValueError (int()'s, float()'s), an OSError or OverflowError without the variable's name,
    or (NaN, inf buckets) taken into a histogram with a bucket that is no bound."""
    from datamover.errors import ConfigError

    no_telemetry_env.setenv("NIXL_TELEMETRY_ENABLE", "y")
    no_telemetry_env.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    for name, value in env.items():
        no_telemetry_env.setenv(name, value)
    with pytest.raises(ConfigError, match=said) as err:
        nixl_agent("bad-env", nixl_agent_config(backends=[]))
    assert err.value.path == var


def test_the_prometheus_endpoint_bounds_its_clients(no_telemetry_env):
    """It binds 0.0.0.0 by default, and gave every connection a thread for ever (40 silent clients, 39 threads)."""
    import socket
    import threading
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("ENABLE", "y"), ("EXPORTER", "prometheus"), ("PROMETHEUS_PORT", str(port))):
        no_telemetry_env.setenv(f"NIXL_TELEMETRY_{name}", value)
    no_telemetry_env.setenv("NIXL_TELEMETRY_PROMETHEUS_LOCAL", "y")
    with nixl_agent("prom-http", nixl_agent_config(backends=[])):
        before = threading.active_count()
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        time.sleep(0.5)
        assert threading.active_count() - before <= 16
        for sock in socks:
            sock.close()
        time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            assert b"agent_tx_bytes_total" in answer.read()
    with pytest.raises(ConnectionRefusedError):  # closing the agent closed the endpoint's socket
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
