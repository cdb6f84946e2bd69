"""Pacing's look-ups of the worker's tcp sockets for the progress thread, on a schedule: soon after an initiator
on another machine says hello (its workers connect over the next milliseconds, each its own socket), then every
half second. A data worker's connection comes up after the hello's: looked up only every half second, a short
first transfer's stream came in on a socket the thread was never handed."""

from __future__ import annotations

from types import SimpleNamespace

from datamover.backends.ucx.pacing import Pacing
from datamover.backends.ucx.params import DEFAULT_PARAMS


def _pacing(monkeypatch) -> tuple[Pacing, list[float]]:
    progress = SimpleNamespace(tune=lambda *a: None)
    backend = SimpleNamespace(params=dict(DEFAULT_PARAMS), _rma_native=False, _progress=progress)
    pacing = Pacing(backend)
    scans: list[float] = []
    monkeypatch.setattr(pacing, "set_progress_cork", lambda: scans.append(now[0]))
    now = [0.0]

    def at(t: float) -> None:
        now[0] = t
        pacing.rescan_cork(t)

    pacing.at = at  # type: ignore[attr-defined]
    return pacing, scans


def test_sockets_are_looked_up_soon_after_each_far_hello_then_every_half_second(monkeypatch):
    pacing, scans = _pacing(monkeypatch)
    pacing.at(100.0)  # serving nobody on another machine: no look-up
    assert scans == []
    pacing.serving_far()
    for ms in range(0, 2000):
        pacing.at(100.0 + ms * 1e-3)
    gaps = [round(b - a, 3) for a, b in zip(scans, scans[1:])]
    # at once, then about 10 ms later, twice as long each time, up to half a second
    assert scans[0] == 100.0 and gaps[:6] == [0.01, 0.021, 0.041, 0.081, 0.161, 0.32], gaps
    assert set(gaps[6:]) == {0.501}, gaps
    scans.clear()
    pacing.serving_far()  # a second initiator: soon again
    for ms in range(0, 12):
        pacing.at(102.0 + ms * 1e-3)
    assert [round(t - 102.0, 3) for t in scans] == [0.0, 0.01]


def test_only_a_read_from_a_far_peer_over_emulated_rma_pauses_its_waiter():
    backend = SimpleNamespace(params=dict(DEFAULT_PARAMS), _rma_native=False, _progress=None)
    pacing = Pacing(backend)
    far, near = SimpleNamespace(elsewhere=True), SimpleNamespace(elsewhere=False)
    read_pause = DEFAULT_PARAMS["far_read_pause_us"] * 1e-6
    assert read_pause > 0
    assert pacing.drive_pause_s(far, "READ") == read_pause
    assert pacing.drive_pause_s(far, "WRITE") == 0.0  # a WRITE's waiter refills the socket as it drains
    assert pacing.drive_pause_s(near, "READ") == 0.0
    backend._rma_native = True  # RDMA: no tcp socket to take the replies from
    assert pacing.drive_pause_s(far, "READ") == 0.0
    backend._rma_native = False
    backend.params.update(far_drive_pause_us=50, far_read_pause_us=0)
    assert pacing.drive_pause_s(far, "READ") == pacing.drive_pause_s(far, "WRITE") == 50 * 1e-6
