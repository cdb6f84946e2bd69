"""A pause at a known point in the middle of a one-sided transfer, for tests of peers dying mid-transfer.

``MidTransferPause`` parks this process's one-sided data movement halfway through, until ``release()``: a
direct cma copy after its first chunk (the next chunk waits), a UCX put/get right after its rows were posted
(their completion waits). ``reached`` is set once something waits there, so a test knows the transfer is in
flight with bytes moved or posted, instead of hoping a big enough transfer is still running after a sleep.
"""

from __future__ import annotations

import threading
from typing import Any


class MidTransferPause:
    """Install with ``install()`` (or as a context manager); ``release()`` lets every parked mover go on."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._gate = threading.Event()
        self._undo: list[tuple[Any, str, Any]] = []

    def _park(self) -> None:
        self.reached.set()
        self._gate.wait()

    def install(self) -> MidTransferPause:
        from ..backends.ucx import cma
        from ..backends.ucx import rma as ucx_rma

        real_run, real_post, real_native = cma.CmaPlan.run, ucx_rma.post_rows, ucx_rma.post_native
        chunks = [0]

        def run(plan: Any, pid: int, write: bool, first: int = 0, last: int | None = None) -> Any:
            chunks[0] += 1
            if chunks[0] > 1:  # the first chunk is copied; every later one waits
                self._park()
            return real_run(plan, pid, write, first, last)

        def post_rows(get: bool, ep: int, rows: list) -> int:
            status = real_post(get, ep, rows)
            self._park()  # posted, not progressed: the requests stay in flight
            return status

        def post_native(get: bool, ep: int, rows: Any, progress: Any = None) -> Any:
            got = real_native(get, ep, rows, progress)
            self._park()  # rows and flush posted in C, not progressed: in flight
            return got

        self._undo = [
            (cma.CmaPlan, "run", real_run),
            (ucx_rma, "post_rows", real_post),
            (ucx_rma, "post_native", real_native),
        ]
        cma.CmaPlan.run = run  # type: ignore[method-assign]
        ucx_rma.post_rows = post_rows
        ucx_rma.post_native = post_native
        return self

    def release(self) -> None:
        """Undo the pause and let every parked mover continue."""
        for owner, name, real in self._undo:
            setattr(owner, name, real)
        self._undo = []
        self._gate.set()

    def __enter__(self) -> MidTransferPause:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.release()
