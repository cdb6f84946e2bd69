"""How the ucx backend paces UCX progress: the native progress thread (started, tuned to the far_ settings once
a peer on another machine is served over tcp, handed the sockets to cork), and how long a waiter spins, pauses
or corks a READ for each peer; with the texts `describe()` gives about them.
"""

from __future__ import annotations

from typing import Any

from . import rma, tcp_sockets
from .config import log

_RESCAN_S = 0.5  # the worker's tcp sockets looked up again this often while serving peers on other machines
_RESCAN_FIRST_S = 0.005  # ... and this soon after an initiator's hello, doubling up to _RESCAN_S


class Pacing:
    """The progress thread's settings and the waiters' for the backend ``b`` (its ``_progress`` is the thread)."""

    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.serving_far_tcp = False  # an initiator on another machine was served over tcp (see serving_far)
        self.cork_scan = 0.0  # when the worker's sockets were last looked up for the progress thread to cork
        self.cork_scan_every = _RESCAN_S  # how long until the next look (shorter just after an initiator said hello)
        self.cork_found: tuple[tuple[int, int], ...] = ()  # what it was handed

    def start_progress(self) -> bool:
        """Hand UCX's progress to a native thread where the extension is built; False: this thread progresses it."""
        b = self.b
        lib = rma.native() if b.params["native_progress"] else None
        b._data = None
        if lib is not None:
            try:
                if b.params["data_worker"] and b._one_sided and not b.params["error_handling"]:
                    b._data = lib.DataWorker(b._ctx.handle, b._ctx)
                spin_s, poll_s, stream_s, stream_bytes = self.progress_times()
                b._progress = lib.Progress(
                    b._worker.handle,
                    spin_s,
                    poll_s=poll_s,
                    stream_poll_s=stream_s,
                    stream_bytes=stream_bytes,
                    data=b._data,
                )
                return True
            except OSError as exc:
                if b._data is not None:
                    b._data.close()
                    b._data = None
                log.warning("no native UCX progress thread for %s (%s): progressing from Python", b.host.name, exc)
        return False

    def progress_times(self) -> tuple[float, float, float, int]:
        """(spin, timer poll, timer poll after a stream came in) seconds after work for the native progress
        thread, and the bytes a stream brings before that poll starts: the far_ ones once it serves a peer on
        another machine over tcp (``serving_far``; no stream poll before)."""
        far = "far_" if self.serving_far_tcp else ""
        params = self.b.params
        stream_s = float(params["far_stream_poll_us"]) * 1e-6 if self.serving_far_tcp else 0.0
        spin_s, poll_s = float(params[f"{far}progress_spin_us"]) * 1e-6, float(params[f"{far}progress_poll_us"]) * 1e-6
        return spin_s, poll_s, stream_s, int(params["far_stream_poll_bytes"])

    def serving_far(self) -> None:
        """An initiator on another machine said hello: where UCX emulates its put/get over tcp (no RDMA transport),
        the progress thread takes the far_ settings from now on."""
        if self.b._rma_native:
            return
        # its endpoints connect to this worker's over the next milliseconds (each of its workers its own socket):
        # look for them soon, then less often
        self.cork_scan_every = _RESCAN_FIRST_S
        if self.serving_far_tcp:
            return
        self.serving_far_tcp = True
        if self.b._progress is not None:
            self.b._progress.tune(*self.progress_times())

    def drive_spin_s(self, peer: Any) -> float:
        """How long a waiter polls UCX without progress before sleeping, for a request to ``peer``."""
        return self.drive_s(peer, "drive_spin_us")

    def drive_pause_s(self, peer: Any, op: str) -> float:
        """How long a waiter driving ``op`` to ``peer`` pauses on the CPU after a progress call that found nothing:
        drive_pause_us, and for a READ from a peer on another machine over tcp at least far_read_pause_us."""
        pause = self.drive_s(peer, "drive_pause_us")
        if op == "READ" and self.far_tcp(peer):
            pause = max(pause, float(self.b.params["far_read_pause_us"]) * 1e-6)
        return pause

    def drive_s(self, peer: Any, key: str) -> float:
        """A waiter's setting ``key`` (in microseconds) for a request to ``peer``, in seconds: its far_ one for a
        peer on another machine whose put/get UCX emulates over tcp."""
        return float(self.b.params[f"far_{key}" if self.far_tcp(peer) else key]) * 1e-6

    def far_tcp(self, peer: Any) -> bool:
        """Whether ``peer`` is on another machine and UCX emulates put/get to it over tcp (no RDMA transport)."""
        return bool(peer.elsewhere) and not self.b._rma_native

    def read_cork_rows(self, peer: Any) -> float:
        """READs to ``peer`` of at least this many rows are posted with its tcp sockets corked (inf: never)."""
        rows = int(self.b.params["far_read_cork_rows"])
        return rows if rows > 0 and self.far_tcp(peer) else float("inf")

    def rescan_cork(self, now: float) -> None:
        """While serving peers on other machines over tcp, look the worker's sockets up again: every half second,
        and after an initiator's hello at 5 ms, then twice as long each time."""
        if (
            self.serving_far_tcp
            and self.b._progress is not None
            and self.watches_streams()
            and now - self.cork_scan > self.cork_scan_every
        ):
            self.cork_scan = now
            self.cork_scan_every = min(2 * self.cork_scan_every, _RESCAN_S)
            self.set_progress_cork()

    def watches_streams(self) -> bool:
        """Whether the progress thread watches the worker's tcp sockets for put streams coming in: to cork them
        (far_progress_cork) or to poll on a timer after them (far_stream_poll_us)."""
        params = self.b.params
        return bool(params["far_progress_cork"]) or float(params["far_stream_poll_us"]) > 0

    def set_progress_cork(self) -> None:
        """Hand the native progress thread the worker's tcp sockets to watch for streams coming in (to cork them
        through a burst, far_progress_cork; to poll after it, far_stream_poll_us); UCX opens them as peers
        connect, so this is looked up again every half second while serving."""
        found: tuple[tuple[int, int], ...] = ()
        if self.watches_streams():
            found = tcp_sockets.sockets_to(rma.native().worker_efd(self.b._worker.handle), None)
        if found != self.cork_found:
            self.cork_found = found
            self.b._progress.set_cork(found, bool(self.b.params["far_progress_cork"]))

    # -- what describe() says ----------------------------------------------------
    def read_cork_text(self) -> str:
        """``describe()``'s "READ cork": the READs posted corked, and the sockets found for each peer."""
        b = self.b
        rows, lib = int(b.params["far_read_cork_rows"]), rma.native()
        if not rows or b._rma_native or lib is None:
            return "off"
        corked = {name: len(p.cork[1]) for name, p in list(b._peers.items()) if p.elsewhere and p.cork is not None}
        every = int(b.params["far_read_cork_push"])
        push = f"every {every} rows" if every else "once the flush is posted"
        return (
            f"READs of >= {rows} rows from peers on other machines over tcp post their gets with the worker's tcp "
            f"sockets to the peer corked (TCP_CORK), let out {push}; sockets found {corked}; posts corked in this "
            f"process {lib.post_stats()['corked']}"
        )

    def data_worker_text(self) -> str:
        """``describe()``'s "data worker": where one-sided rows are posted, and why."""
        b, lib = self.b, rma.native()
        if b._data is None:
            if not b._one_sided or lib is None or not b.params["native_progress"]:
                return "none: one-sided rows are not posted in C here"
            why = "data_worker is off" if not b.params["data_worker"] else "error_handling is on"
            return f"none ({why}): one-sided rows share ucxx's (multi-threaded) worker"
        return (
            "one-sided rows go through a UCP worker of this backend's own in serialized mode (one mutex of ours "
            "around each call, no UCX worker lock per put/get); workers closed with operations still queued, "
            f"left undestroyed, in this process: {lib.post_stats()['leaked_workers']}"
        )

    def progress_cork_text(self) -> str:
        """``describe()``'s "progress cork": the sockets the progress thread corks during bursts."""
        if self.b.params["far_progress_cork"] and self.b._progress is not None:
            return (
                "tcp sockets corked during bursts while a stream of small rows comes in on them:"
                f" {len(self.cork_found)} handed"
                f" ({', '.join(tcp_sockets.names(self.cork_found))})"
            )
        return "off"

    def progress_mode(self) -> str:
        """``describe()``'s "UCX progress": who progresses UCX, and how it spins and polls after work."""
        if self.b._progress is None:
            return "the service thread"
        spin_s, poll_s, stream_s, stream_bytes = self.progress_times()
        mode = "a native thread on UCX's event fd"
        if spin_s:
            mode += f", spinning {spin_s * 1e6:g} us after work"
        if poll_s:
            mode += f", polling every {poll_s * 1e6:g} us after work while work keeps coming"
        elif stream_s:
            mode += (
                f", polling every {stream_s * 1e6:g} us after work while a stream of puts comes in (once it brought"
                f" {stream_bytes} bytes)"
            )
        near = (float(self.b.params["progress_spin_us"]), float(self.b.params["progress_poll_us"]))
        tuned = self.serving_far_tcp and ((spin_s * 1e6, poll_s * 1e6) != near or stream_s > 0)
        return mode + (" (for peers on other machines over tcp)" if tuned else "")
