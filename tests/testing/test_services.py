"""The loopback services' ports: picked where outgoing connections cannot take them."""

import socket

from datamover.testing import services


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """The kernel gives ports of its ephemeral range to every outgoing connection: one picked there can be gone
    before the server binds it, or while a restarted server is down (as test_etcd_restart's etcd is)."""
    low = services._ephemeral_low()
    ports = {services.free_port() for _ in range(20)}
    assert all(services._LOWEST <= p < low for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_with_no_room_below_the_range_any_free_port_is_taken(monkeypatch):
    monkeypatch.setattr(services, "_ephemeral_low", lambda: services._LOWEST)
    port = services.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
