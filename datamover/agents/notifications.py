"""Notifications an agent received: queued by sender within bounds, drained or waited for by prefix."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

from ..errors import InvalidParameter, NotificationTimeout, shown

log = logging.getLogger("datamover.agent")

#: what one queued notification is counted to keep besides its bytes (the bytes object and its queue slot)
_MESSAGE_OVERHEAD = 64


@dataclass(frozen=True)
class InboxLimits:
    """How much the inbox holds for one sender and for all together (messages, and bytes with overhead): past
    either, the oldest of that sender (of the sender holding the most bytes, for the totals) is dropped, counted."""

    max_per_sender: int = 1 << 16
    max_sender_bytes: int = 64 << 20
    max_messages: int = 1 << 20
    max_bytes: int = 256 << 20

    @classmethod
    def from_config(cls, values: object) -> InboxLimits:
        """The limits a config's ``extra["inbox"]`` names (InvalidParameter for anything else)."""
        if not isinstance(values, dict) or set(values) - set(cls.__dataclass_fields__):
            raise InvalidParameter(
                f"config extra 'inbox' takes {', '.join(cls.__dataclass_fields__)}, got {shown(values)}"
            )
        return cls(**values)

    def __post_init__(self) -> None:
        for name in ("max_per_sender", "max_sender_bytes", "max_messages", "max_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidParameter(f"inbox limit {name!r} must be a positive integer, got {value!r}")


class Notifications:
    """The notification inbox of one agent; ``deliver`` may be called from any backend thread.

    ``dropped_by_sender`` counts the notifications dropped to keep within ``limits`` (logged as they happen).
    """

    def __init__(self, limits: InboxLimits | None = None) -> None:
        self.limits = limits or InboxLimits()
        self._cond = threading.Condition()
        self._msgs: dict[str, collections.deque[bytes]] = {}
        self._bytes: dict[str, int] = {}
        self._count = self._total = 0
        self._dropped: collections.Counter[str] = collections.Counter()

    def deliver(self, peer: str, message: bytes) -> None:
        """Queue ``message`` from ``peer`` and wake the waiters; the oldest go first past the limits."""
        message = bytes(message)
        lim = self.limits
        with self._cond:
            self._msgs.setdefault(peer, collections.deque()).append(message)
            self._bytes[peer] = self._bytes.get(peer, 0) + len(message) + _MESSAGE_OVERHEAD
            self._count += 1
            self._total += len(message) + _MESSAGE_OVERHEAD
            while len(self._msgs[peer]) > lim.max_per_sender or self._bytes[peer] > lim.max_sender_bytes:
                self._drop_oldest(peer)
                if peer not in self._msgs:
                    break
            while self._count > lim.max_messages or self._total > lim.max_bytes:
                self._drop_oldest(max(self._bytes, key=self._bytes.__getitem__))
            self._cond.notify_all()

    def _drop_oldest(self, peer: str) -> None:
        msgs = self._msgs[peer]
        self._forget(peer, len(msgs.popleft()))
        self._dropped[peer] += 1
        n = self._dropped[peer]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... drop: a flood is logged, not logged for every message
            log.warning("notification inbox full: %d notification(s) from %r dropped so far (oldest first)", n, peer)

    def _forget(self, peer: str, size: int) -> None:
        """Account for one message of ``size`` bytes gone from ``peer``'s queue."""
        self._bytes[peer] -= size + _MESSAGE_OVERHEAD
        self._count -= 1
        self._total -= size + _MESSAGE_OVERHEAD
        if not self._msgs[peer]:
            del self._msgs[peer], self._bytes[peer]

    def dropped_by_sender(self) -> dict[str, int]:
        """How many notifications of each sender were dropped so far, oldest first, to keep within the limits."""
        with self._cond:
            return dict(self._dropped)

    def drain(self) -> dict[str, list[bytes]]:
        """Every notification received so far, by sender; the inbox is empty afterwards."""
        with self._cond:
            out, self._msgs, self._bytes = self._msgs, {}, {}
            self._count = self._total = 0
        return {peer: list(msgs) for peer, msgs in out.items()}

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
                    self._forget(sender, len(m))
                    return sender, m
        return None
