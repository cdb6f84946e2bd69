"""The service thread: one loop owns the UCX worker and every control socket; callers hand it commands."""

from __future__ import annotations

import gc
import os
import selectors
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...errors import (
    AuthenticationError,
    DatamoverError,
    InvalidMetadata,
    RemoteDisconnected,
)
from . import rma
from .config import log
from .messages import Cancel, Req
from .protocol import FrameConn
from .retired import quiesced
from .state import Inbound, Peer


class ServiceLoop:
    """The service thread: one loop owns the UCX worker and every control socket; callers hand it commands."""

    # -- plumbing between caller threads and the service thread ---------------
    def _submit(self, fn: Callable[[], None]) -> None:
        # under the lock the service thread's end takes: a command is either refused here or run by that end
        with self._ending:
            if self._stop:
                why = "closed" if self._closed else "stopped: its service thread ended"
                raise RemoteDisconnected(f"the ucx backend is {why}", backend=self.name)
            self._cmds.append(fn)
        self._wake()

    def _wake(self) -> None:
        """Wake the service thread from its wait in select (a full pipe already will; a closed one means stopped)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _watch_ucx(self, on: bool) -> None:
        """Put UCX's event fd in the service thread's selector, or take it out while a waiter progresses UCX."""
        if on != self._ucx_watched:
            if on:
                self._sel.register(self._worker.epoll_file_descriptor, selectors.EVENT_READ, "ucx")
            else:
                self._sel.unregister(self._worker.epoll_file_descriptor)
            self._ucx_watched = on

    def _call(self, fn: Callable[[], None], timeout: float | None = None) -> bool:
        """Run ``fn`` on the service thread and wait for it; its exception is re-raised here.

        With ``timeout``, False when the service thread did not get to it in time (it still runs it later).
        """
        if threading.current_thread() is self._thread:
            fn()
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        box: list[BaseException] = []
        ev = threading.Event()

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                box.append(exc)
            ev.set()

        self._submit(run)
        while not ev.wait(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
            if not self._thread.is_alive():
                raise RemoteDisconnected("the ucx service thread is not running", backend=self.name)
            if deadline is not None and time.monotonic() >= deadline:
                return False
        if box:
            raise box[0]
        return True

    # -- service thread ---------------------------------------------------------
    def _run(self) -> None:
        spin = float(self.params["spin_us"]) * 1e-6
        last = time.monotonic()
        last_scan = 0.0
        try:
            while not self._stop:
                worker = self._worker
                busy = False
                while self._cmds:
                    busy = True
                    try:
                        self._cmds.popleft()()
                    except Exception as exc:  # a bug in one command must not stop the service for every peer
                        log.error("ucx command failed: %s", _trace(exc))
                n = 0
                # a waiter progressing the same worker does this thread's UCX work too; two threads
                # progressing one worker only contend for its lock (and the GIL)
                while not self._drivers and self._progress is None and worker.progress_once() and n < 64:
                    n += 1
                busy |= n > 0
                if self._active_out or self._active_in or self._revokes:
                    busy |= bool(self._step(self.tagged._check_requests))
                if self._directs:
                    self._step(self.one_sided._check_directs)
                now = time.monotonic()
                if self._cut_drains:  # cancelled requests' UCX operations given time to end (see Fencing._cut)
                    self._step(self._cut_drains.check, now, lambda: self._worker)
                if now - last_scan > 0.005:
                    last_scan = now
                    self._step(self._check_cancelled)
                    self._step(self._check_handshakes, now)
                    self._step(self._bury)
                    self._step(self._maybe_recycle)
                    if self.losses.pending:
                        self._step(self.losses.check, now)
                    self._step(self._drop_silent, now)
                    self._step(self.pacing.rescan_cork, now)
                if busy:
                    last = now
                if self._drivers:
                    # a waiter progresses UCX: sleep on sockets and commands only, leaving it the GIL (UCX's
                    # event fd stays readable while nobody arms the worker, so it is left out of the wait)
                    self._watch_ucx(False)
                    self._step(self._poll, 0.005)
                    continue
                if self._progress is not None:
                    # the native thread progresses UCX; it wakes this one after work while requests are in flight
                    in_flight = self._in_flight()
                    self._progress.set_notify(self._wake_w if in_flight else -1)
                    if busy or any(not d.driven and not d.held() for d in list(self._directs)):
                        # what this thread (or a caller nobody waits for) posted raises no UCX event: have it
                        # progressed; a caller's waiter drives its own request (and holds the native thread off)
                        self._progress.kick()
                    if self._step(self._poll, 0.0 if busy else (0.001 if in_flight else 0.05)):
                        last = time.monotonic()
                    continue
                self._watch_ucx(True)
                if self._step(self._poll, 0.0):
                    last = now
                    continue
                if now - last < spin or self._cmds:
                    # spinning: let the caller's threads take the GIL now rather than at the next switch interval
                    time.sleep(0)
                    continue
                if not worker.arm():
                    continue
                # with requests in flight wake often: ucxx can finish a request without a UCX event firing
                in_flight = self._in_flight()
                if self._step(self._poll, 0.001 if in_flight else 0.05):
                    last = time.monotonic()
        except BaseException as exc:  # logged, not raised: its end below fails what waits on it
            log.error("ucx service thread of %s died: %s", self.host.name, _trace(exc))
        finally:
            # an exception raised on this thread and kept (a transfer's error, a log record) holds this frame
            # through its traceback after the thread ended: it must not hold a worker
            worker = None
            with self._ending:  # no command is accepted from here on; _shutdown fails those queued and in flight
                self._stop = True
            try:
                self._shutdown()
            finally:
                self._free()
                with self._ending:
                    self._ended, orphaned = True, self._orphaned
                if orphaned:  # close() returned without them (the cma pool's threads may wait on this one)
                    self._close_rest(wait=False)
                    gc.collect()  # UCX objects caught in reference cycles; otherwise close() collects, once

    def _step(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One periodic step of the loop; a bug in it is logged and the loop goes on serving every peer (False)."""
        try:
            return fn(*args)
        except Exception as exc:
            log.error("ucx service step %s failed: %s", getattr(fn, "__qualname__", fn), _trace(exc))
            return False

    def _in_flight(self) -> bool:
        """Whether requests are in flight (or cancelled ones draining): the loop then wakes every millisecond."""
        return bool(self._active_out or self._active_in or self._revokes or self._directs or self._cut_drains)

    def _poll(self, timeout: float) -> bool:
        """Handle ready sockets (waiting up to ``timeout`` s); True when something happened."""
        for conn in self._all_conns():
            want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write else 0)
            key = self._sel.get_map().get(conn.sock)
            if key is not None and key.events != want:
                self._sel.modify(conn.sock, want, key.data)
        events = self._sel.select(timeout)
        woke = False
        for key, mask in events:
            what = key.data
            # UCX's event fd stays readable until the next arm(): not a reason to keep spinning
            woke |= what != "ucx" or timeout > 0
            if what == "wake":
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            elif what == "listen":
                self._accept()
            elif what == "ucx":
                pass
            elif what.conn is not None:
                if mask & selectors.EVENT_WRITE:
                    what.conn.flush()
                if mask & selectors.EVENT_READ:
                    self._read(what)
        return woke

    def _all_conns(self) -> list[FrameConn]:
        out = [p.conn for p in self._peers.values() if p.conn is not None]
        out += [i.conn for i in self._inbound.values()]
        return out

    def _wait_until(self, probe: Callable[[], None], box: list[bool], deadline: float) -> bool:
        """Run ``probe`` on the service thread until it reports False (True) or the deadline passes (False)."""
        while True:
            box.clear()
            self._call(probe)
            if not box[0]:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)

    def _read(self, owner: Peer | Inbound) -> None:
        conn = owner.conn
        while True:
            if not self._read_once(owner):
                return
            if conn.closed or not conn.has_frame:  # else: a handshake frame was handled before the frames read
                break  # with it, which its bounds and key judge
        if conn.closed:
            self.losses.lost(owner, None)

    def _read_once(self, owner: Peer | Inbound) -> bool:
        """Read and handle what ``feed`` returns; False once the connection was lost."""
        conn = owner.conn
        try:
            msgs = conn.feed()
        except (AuthenticationError, InvalidMetadata) as exc:
            self.losses.lost(owner, exc)
            return False
        # a request cancelled by its initiator before this side read it is never started: its cancel comes in
        # the same read or a later one, so look ahead
        cancelled = {m.id for m in msgs if type(m) is Cancel} if isinstance(owner, Inbound) else ()
        for msg in msgs:
            if cancelled and type(msg) is Req and msg.id in cancelled:
                log.info("not serving request %d of %r: cancelled by its initiator", msg.id, owner.name)
                continue
            try:
                if isinstance(owner, Peer):
                    self._on_peer_msg(owner, msg)
                else:
                    self._on_inbound_msg(owner, msg)
            except (AuthenticationError, InvalidMetadata, RemoteDisconnected) as exc:
                self.losses.lost(owner, exc)
                return False
            except (KeyError, TypeError, ValueError) as exc:
                self.losses.lost(owner, InvalidMetadata(f"malformed control message {msg.WIRE!r}: {exc}"))
                return False
            except Exception as exc:  # e.g. UCX refusing an address: drop this connection, keep serving
                log.error("handling control message %r failed: %s", msg.WIRE, _trace(exc))
                self.losses.lost(owner, DatamoverError(f"{type(exc).__name__}: {exc}", backend=self.name))
                return False
        return True

    def _maybe_recycle(self) -> None:
        """Replace the worker, freeing what peers that went left on it, once ``recycle_after_departed`` connections
        to peers on this host closed and this agent is wholly idle.

        UCX 1.21 keeps an endpoint that a peer's wireup made here (for the replies of its emulated puts and gets),
        and one of ours the peer connected back to, until the worker goes when error handling is off:
        ``ucp_ep_disconnected`` keeps an endpoint flagged remote-connected when it is closed in flush mode, a
        forced close is refused (``ucp_ep_close_nbx``: UCS_ERR_INVALID_PARAM), and nothing destroys it for a
        peer that went (no keepalive lane without error handling, hence no EP_CHECK / EP_REMOVED), so each holds
        that peer's shared-memory segments mapped. Only replacing the worker frees them. A peer's one-sided
        operations are not seen here, so that is safe only with no control connection open at all (a peer
        reaches this worker only with the address of a welcome), nothing of this agent's in flight or being let
        go (no request, drain or probe; closed endpoints go with the worker, as in any reset), and no command
        waiting: no transfer fails for it, and the next one to a peer connects again.
        """
        limit = int(self.params["recycle_after_departed"])
        if not limit or self.departed < limit or self._inbound or self._resetting or self._cmds:
            return
        if any(p.state != "idle" or p.ops or p.queue for p in self._peers.values()):
            return
        if (
            self._active_out or self._active_in or self._directs or self._cma_ops or self._revokes
            or self._cut_drains or self._draining or len(self._retired) or self.losses.pending
        ):  # fmt: skip
            return
        # no peer is ready, and only this thread makes one so: a caller's post goes through this thread's queue
        self._reset_worker(f"{self.departed} connections to peers on this host closed since it was made", routine=True)
        self.recycles += 1

    def _reset_worker(
        self, reason: str, quarantine: bool = False, culprit: str | None = None, routine: bool = False
    ) -> None:
        """Replace the UCX worker: every connection drops (its transfers fail), peers reconnect on next use.

        The old worker is freed at once (its file descriptors and memory with
        it) unless ``quarantine``: then a cancelled transfer still has UCX
        operations pointing into its caller's memory (a READ's gets or receives,
        a WRITE's queued puts or sends), and the old worker is kept, never
        progressed again, until ``close()``, and counted against ``culprit``,
        the peer of that transfer (see ``_held``). A worker with cancelled requests still draining on it
        (``cancel_drain``) is kept so too, against the first one's peer; their drains end with it.
        """
        drained = self._cut_drains.on(self._worker)
        if drained and not quarantine:  # cancelled requests' operations on it still point into callers' memory
            quarantine, culprit = True, drained[0].peer
        if routine:  # _maybe_recycle: nothing is connected or in flight
            log.info("replacing the UCX worker of %s (to free what peers left on it): %s", self.host.name, reason)
        else:
            log.warning("resetting the UCX worker of %s: %s", self.host.name, reason)
        self.losses.on_reset()  # its hang-ups' receives and probes, and its prober, were on the worker being replaced
        why = RemoteDisconnected(f"UCX worker reset ({reason}); retry the transfer", backend=self.name)
        self._resetting = True  # the peers' disconnects below need no reset of their own
        try:
            for peer in list(self._peers.values()):
                self._disconnect_peer(peer, why)
        finally:
            self._resetting = False
        for inbound in list(self._inbound.values()):
            self._drop_inbound(inbound)
        if self._ucx_watched:
            self._sel.unregister(self._worker.epoll_file_descriptor)
        if self._progress is not None:  # stopped before its worker can be freed
            self._progress.close()
            self._progress = None
        self._retire_ep(self._self_ep)  # every endpoint closed, so that freeing them does not wait on a peer
        old = (self._worker, self._graveyard, self._draining, self._data)
        if quarantine:
            self._quarantined.append(old)
            if culprit is not None:
                self._quarantines_by[self._process_of(culprit)] += 1
        self._graveyard, self._draining, self._self_ep = [], [], None
        del old
        self._worker = self._ucx.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._address = self._worker.address.tobytes()
        if self._ucx_watched:
            self._sel.register(self._worker.epoll_file_descriptor, selectors.EVENT_READ, "ucx")
        self.pacing.start_progress()
        self.departed = 0  # what peers left went with the old worker
        if not routine:
            self.resets += 1

    def _bury(self) -> None:
        """Let closed endpoints go once their cancelled requests had time to finish, and in-flight requests let
        go once they ended (or, late, cancelled with the worker quiesced: see retired.py)."""
        now = time.monotonic()
        self._graveyard = [(t, ep) for t, ep in self._graveyard if now - t < 10.0]
        draining, self._draining = self._draining, []
        for d in draining:
            if d.step(now):
                self._draining.append(d)
            else:
                self._retired.add(d.reqs)
        del draining
        self._retired.sweep(float(self.params["cancel_drain_s"]), self._quiesced)

    def _quiesced(self) -> AbstractContextManager[None]:
        """While in it nothing but this thread progresses the worker: ucxx requests may be cancelled safely."""
        return quiesced(self._progress_gate, self._progress)

    def _destroy_rkey(self, rkey: int) -> None:
        """Let go of a peer's unpacked rkey, on the worker it was unpacked for."""
        if self._data is not None:
            self._data.rkey_destroy(rkey)
        else:
            rma.rkey_destroy(rkey)

    def _retire_ep(self, ep: Any) -> None:
        if ep is None:
            return
        try:
            ep.close()
        except Exception as exc:
            log.debug("closing endpoint: %s", exc)
        self._graveyard.append((time.monotonic(), ep))

    # -- lifetime ---------------------------------------------------------------
    def _free(self) -> None:
        """The service thread's last act: let go of every UCX object (endpoints, then workers with their fds,
        shared memory and async events, then the context), so that they are gone when close() returns."""
        if self._progress is not None:  # before the worker it progresses goes
            self._progress.close()
            self._progress = None
        self._peers.clear()
        self._inbound.clear()
        self._directs.clear()
        self._checked.clear()
        self._graveyard, self._draining, self._self_ep, self._quarantined = [], [], None, []
        self._retired.clear()  # nothing progresses the worker any more
        if self._data is not None:
            self._data.close()
            self._data = None
        self._cut_drains.release()
        self.losses.free()  # a request's UCX objects go before its endpoint's
        self._quarantines_by.clear()
        self._worker = self._ctx = None  # type: ignore[assignment]

    def _shutdown(self) -> None:
        why = RemoteDisconnected("the ucx backend was closed", backend=self.name)
        for name in list(self._peers):
            self._drop_peer(name, why)
        for inbound in list(self._inbound.values()):
            self._drop_inbound(inbound)
        self.mapped_regions.unmap_all()
        for fn in list(self._cmds):
            try:
                fn()
            except Exception:
                pass
        self._cmds.clear()
        try:
            self._listener.close()
        except OSError:
            pass


def _trace(exc: BaseException) -> str:
    """An exception with its traceback, as text: a log record holding the exception itself would keep the
    service thread's frames (and the UCX objects in them) alive for as long as the record lives."""
    return "".join(traceback.format_exception(exc)).rstrip()
