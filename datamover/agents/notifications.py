"""Notifications an agent received: queued by sender, drained or waited for by prefix."""

from __future__ import annotations

import threading
import time

from ..errors import NotificationTimeout


class Notifications:
    """The notification inbox of one agent; ``deliver`` may be called from any backend thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._msgs: dict[str, list[bytes]] = {}

    def deliver(self, peer: str, message: bytes) -> None:
        """Queue ``message`` from ``peer`` and wake the waiters."""
        with self._cond:
            self._msgs.setdefault(peer, []).append(bytes(message))
            self._cond.notify_all()

    def drain(self) -> dict[str, list[bytes]]:
        """Every notification received so far, by sender; the inbox is empty afterwards."""
        with self._cond:
            out, self._msgs = self._msgs, {}
        return out

    def wait(self, prefix: bytes, timeout: float, peer: str | None) -> tuple[str, bytes]:
        """Remove and return (sender, message) of the first one starting with ``prefix`` (from ``peer`` if given)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = self._take(prefix, peer)
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotificationTimeout(f"no notification starting with {prefix!r} within {timeout:g} s")
                self._cond.wait(left)

    def _take(self, prefix: bytes, peer: str | None) -> tuple[str, bytes] | None:
        for sender, msgs in self._msgs.items():
            if peer is not None and sender != peer:
                continue
            for k, m in enumerate(msgs):
                if m.startswith(prefix):
                    del msgs[k]
                    if not msgs:
                        del self._msgs[sender]
                    return sender, m
        return None
