"""Shared pytest settings."""

import os
import signal
import threading

import pytest
from hypothesis import HealthCheck, settings

# UCX's tcp transport makes lanes over every network interface of this namespace, test hosts' veths included
# (ours, or those of another suite running beside this one, made and deleted while we run: a lane over one that
# goes resets its connection). Agents of the tests on one host talk over loopback; processes on a test host get
# their own UCX_NET_DEVICES, and agents there their own NET_DEVICES.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

pytest_plugins = ["datamover.testing.hosts"]  # the test_hosts fixture

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does, fixtures torn down (services stopped, test hosts deleted,
    files removed), not at once with everything left behind: a CI runner's timeout sends SIGTERM. (xdist's
    controller, interrupted, interrupts its workers, which run the fixtures.) A signal this process was started
    ignoring (nohup) stays ignored; later signals are ignored so that the teardown is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    for s in _STOP_SIGNALS:
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, stop)
    if os.environ.get("PYTEST_XDIST_WORKER") and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # an xdist worker is interrupted by its controller through a simulated SIGINT (interrupt_main), which does
        # nothing while SIGINT is ignored, as it is in a suite a non-interactive shell started in the background:
        # the worker was then killed without its teardown
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def mooncake_master():
    """A real ``mooncake_master`` (with its HTTP metadata server) for the module, or a skip saying why not."""
    from datamover.testing.mooncake import MooncakeMaster, mooncake_available

    ok, reason = mooncake_available()
    if not ok:
        pytest.skip(reason)
    with MooncakeMaster() as m:
        yield m


@pytest.fixture
def sigint_handled():
    """SIGINT handled here for the test (Python's KeyboardInterrupt), so that the processes it starts do not inherit
    an ignored SIGINT: a suite started in the background by a non-interactive shell (as CI may) has SIGINT ignored,
    and ignored signals pass on to children, where Ctrl-C tests would then wait in vain."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
