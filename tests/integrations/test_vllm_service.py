"""The scheduler-to-worker cache service of the vLLM offloading spec: calls, refusals, hostile frames."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from tests.integrations.engine_support import require

require("vllm")

from datamover.integrations.vllm.service import (  # noqa: E402
    _LOCAL,
    MAX_FRAME,
    CacheClient,
    CacheService,
    ServiceError,
    check_keys,
    socket_path,
)


def handler(verb: str, args: list) -> object:
    if verb == "stats":
        return {"ok": 1}
    keys = check_keys(args[0])
    if verb == "lookup":
        return ["l2_dram" if k.startswith(b"a") else None for k in keys]
    raise KeyError(verb)


@pytest.fixture
def service():  # type: ignore[no-untyped-def]
    # an engine id of this process's own: the socket's path is machine-wide (a service there unlinks what was there)
    svc = CacheService(socket_path(f"test-engine-service-{os.getpid()}", 0), handler)
    _LOCAL.pop(svc.path)  # make this process's client go through the socket, as the scheduler's does
    yield svc
    svc.close()


def test_calls_and_refusals_over_the_socket(service: CacheService) -> None:
    client = CacheClient(service.path, timeout_s=5)
    try:
        assert client.call("stats") == {"ok": 1}
        assert client.call("lookup", [b"a1", b"b2"]) == ["l2_dram", None]
        with pytest.raises(ServiceError, match="KeyError"):
            client.call("pin", [b"a"])
        with pytest.raises(ServiceError, match="bytes"):
            client.call("lookup", ["not bytes"])
        with pytest.raises(ServiceError, match="verb"):
            client.call("drop_everything")
        assert client.call("stats") == {"ok": 1}  # still serving the same connection
    finally:
        client.close()


def raw(path: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(payload)
        return s.recv(100)


def test_hostile_frames_are_dropped_without_reading_them(service: CacheService) -> None:
    assert raw(service.path, struct.pack("!I", MAX_FRAME + 1)) == b""  # refused before allocating
    assert raw(service.path, struct.pack("!I", 3) + b"\xc1\xc1\xc1") == b""  # not msgpack
    client = CacheClient(service.path, timeout_s=5)
    try:
        assert client.call("stats") == {"ok": 1}
    finally:
        client.close()


def test_an_absent_worker_is_a_service_error_not_a_hang() -> None:
    client = CacheClient(socket_path("no-such-engine", 7), timeout_s=2)
    with pytest.raises(ServiceError):
        client.call("lookup", [b"x"])


def test_keys_are_bounded() -> None:
    with pytest.raises(ValueError):
        check_keys([b"x"] * 70000)
    with pytest.raises(ValueError):
        check_keys([b"x" * 300])
    with pytest.raises(ValueError):
        check_keys(b"abc")
