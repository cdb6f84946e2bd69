"""The ucx backend's parameters and their defaults (``UcxBackend.default_params``), one comment each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import InvalidParameter

DEFAULT_PARAMS: dict[str, Any] = {
    # control listener: bound here and advertised in the metadata
    "host": "127.0.0.1",
    "port": 0,
    # UCX settings passed to the context, e.g. {"TLS": "tcp"}
    "ucx_config": {},
    # cma lets UCX read a peer's memory with process_vm_readv; when that peer dies mid-transfer UCX
    # (error handling off) aborts the survivor, so unless this is on, TLS defaults to everything but cma
    "cma": False,
    # UCX endpoint error handling: on forces transports that report peer failure (tcp, much slower)
    "error_handling": False,
    # let peers put into and get from this agent's registered memory directly (UCP RMA, as NIXL does:
    # the owner's CPU stays out of the data path) and do the same to peers that allow it; off, every
    # request is checked and served by the owner over tag send/recv
    "one_sided": True,
    # one-sided to a peer on this host that the kernel lets this process attach to (a probe at connect time
    # tells): DRAM rows go with process_vm_writev/readv, up to IOV_MAX rows per syscall, instead of one UCX
    # put/get per row; a peer dying mid-copy makes the copy fail (not this process abort, as UCX's cma does)
    "direct_cma": True,
    # direct cma requests of up to this many bytes are copied inside post() (as posix's inline_bytes): a
    # thread hop costs more than such a copy; larger ones in parts on up to
    # cma_threads threads (a waiting caller copies parts too), so that post() returns at once and large
    # copies use more than one core
    "cma_inline_bytes": 1 << 20,
    "cma_threads": 2,
    # a part is a run of chunks of one syscall each: a quarter of a request per thread, 1 MiB to this
    "cma_chunk_bytes": 8 << 20,
    # where UCX can only emulate put/get (no cma or RDMA: active messages through shared memory or tcp),
    # requests with a row larger than this go through the owner, whose tag rendezvous streams large
    # messages faster
    "emulated_max_bytes": 8 << 20,
    # keep polling UCX this long after the last activity before sleeping in epoll
    "spin_us": 2000,
    # where the native extension is built: a native thread progresses UCX (sleeping on its event fd), so a
    # target whose transport needs it (tcp, emulated put/get) is served without a Python thread waking
    "native_progress": True,
    # ... and one-sided rows go through a UCP worker of their own in serialized mode (ucxx's workers are
    # multi-threaded: UCX then locks the worker around every put/get and progress call), its calls kept apart
    # by one mutex of ours; off, or with error_handling, they share the ucxx worker
    "data_worker": True,
    # how long that thread keeps polling after work before it sleeps on the event fd again (spin_us is the
    # Python service thread's); spinning takes a core from the peer and the caller where cores are few
    "progress_spin_us": 0,
    # after work, that thread sleeps this long on a timer and progresses again while work keeps coming,
    # instead of waking (through the sender's syscall) on each segment a peer streams in; 0: always the fd
    "progress_poll_us": 0,
    # a waiter driving its request polls UCX this long without progress before it sleeps on UCX's event fd
    "drive_spin_us": 50,
    # the same for a peer on another machine whose put/get UCX carries over tcp (no RDMA transport: emulated,
    # so the peer's CPU serves every row), where the flush waits on the network
    "far_drive_spin_us": 50,
    # a waiter whose progress found nothing waits this long on the CPU before asking UCX again (0: at once),
    # near and far peers; each progress is an epoll_wait on UCX's sockets
    "drive_pause_us": 0,
    "far_drive_pause_us": 0,
    # ... and a waiter driving a READ from a peer on another machine over tcp pauses at least this long: each
    # progress is an epoll_wait and a recv, and asked less often it takes the replies coming in several at a time
    # (a WRITE's waiter is not paused: it refills the socket as it drains); 0: as far_drive_pause_us
    "far_read_pause_us": 20,
    # once this agent serves such a peer, its native progress thread spins this long after work, and polls on a
    # timer of far_progress_poll_us after work (progress_spin_us / progress_poll_us until then)
    "far_progress_spin_us": 0,
    "far_progress_poll_us": 0,
    # a READ of at least this many rows from such a peer is posted with this worker's tcp sockets to it corked
    # (TCP_CORK), so its gets (one small request each) leave in full segments once the flush is posted instead
    # of one segment and one pass through both network stacks per row; 0: never
    "far_read_cork_rows": 32,
    # ... and what its gets queued is let out every this many rows (0: once, after the flush), so that the peer
    # could start serving the first rows while the rest are posted
    "far_read_cork_push": 0,
    # once this agent serves such a peer, its native progress thread corks the worker's tcp sockets through each
    # progress call while a stream of small puts comes in on them (tcp_info's byte counts: received four times
    # what was sent, and read at most 2048 times: rows up to about 18 KiB), so their acknowledgements, one per put,
    # leave together instead of a segment each (a call on larger rows makes one acknowledgement: not corked)
    "far_progress_cork": True,
    # ... and after a burst during which such a stream came in, once the stream brought far_stream_poll_bytes
    # (without a pause of 1 ms), it sleeps this long on a timer and progresses again (while work keeps coming)
    # instead of being woken through the sender's syscall by each segment that arrives: fewer, larger reads for
    # a bulk stream, while a shorter transfer is served per arrival (its last bytes would wait for the timer);
    # bursts that send more than they receive (a READ's replies) still block on the event fd; 0: off. The
    # stream's last bytes wait up to this long: 25 us against 50 and 100 in BENCHMARKS.md (session 19)
    "far_stream_poll_us": 25,
    "far_stream_poll_bytes": 2 << 20,
    "connect_timeout_s": 5.0,
    # close() waits this long for the service thread to end (it frees UCX's objects as it ends)
    "close_timeout_s": 60.0,
    # control connections open at once (each holds a socket and up to one frame of buffer); more are refused
    "max_inbound": 1024,
    # bytes of control frames not yet complete that all control connections (peers' and this agent's own) may
    # hold together (each holds at most one frame of up to 64 MiB): a connection that would go over is dropped
    "max_buffered_bytes": 256 << 20,
    # rows of peers' requests this agent has posted sends or receives for (each holds about 700 bytes of UCX
    # request state until it ends, so unauthenticated million-row WRITEs could take gigabytes); a request that
    # would go over is refused with the reason (one of MAX_ROWS rows fits when nothing else is served)
    "max_served_rows": 1 << 20,
    # a request with less than this left of its timeout is not started: it could not finish, and once
    # started its bytes cannot be called back (tag send/recv has no cancel that is safe for the peer)
    "launch_margin_s": 0.001,
    # a transfer cut off (timed out, released) whose UCX operations are still in flight gets this long to end
    # them (a responsive peer does; bytes moved before ERR is reported are allowed) before its UCX worker is
    # replaced and quarantined (below); ERR waits that much longer for a frozen peer
    "cancel_drain_s": 1.0,
    # a transfer cut off with UCX operations still in flight (a READ's gets or receives, a WRITE's puts or
    # sends; a frozen or dying peer) keeps the UCX worker they were posted on, never progressed again, until
    # close(): about a dozen fds each. A peer that made this many quarantines gets its transfers that need
    # UCX operations refused (direct cma, which needs none, still runs), and once this agent holds
    # max_quarantined_workers in all, every such transfer is refused; close() frees them
    "max_quarantines_per_peer": 2,
    # a peer that hangs up while this agent has receives posted for its WRITE: the hang-up is confined to
    # its own requests when, within this many seconds, every one of them ended (the ones it never matched
    # are ended here with empty self-sends) and a probe sent by a second worker of this process came
    # through this worker's shared-memory receive queue (a sender killed mid-message can leave that queue
    # stuck for every sender); else, or at 0, the UCX worker is reset (every peer reconnects)
    "hangup_probe_s": 5.0,
    "max_quarantined_workers": 16,
    # a peer on this host that connected and went leaves UCX endpoints on this agent's worker for as long as the
    # worker lives, and with them that peer's shared-memory segments mapped here (about 4 MiB, 3 maps, 0.6 MiB
    # resident each): UCX 1.21 frees an endpoint that was connected from the other side only with its worker when
    # error handling is off (a close in flush mode keeps it, a forced close is refused, and nothing is sent to the
    # peer either way). Once this many such connections (inbound and outbound) closed, the worker is replaced the
    # next time this agent holds no control connection at all and nothing is in flight or being let go (so no
    # transfer fails for it; the next one to a peer connects again); 0: never
    "recycle_after_departed": 8,
}


#: microsecond parameters with a whole-number default that take fractions too (``check_params`` checks them)
LOOSE_PARAMS = frozenset(
    {
        "progress_spin_us", "progress_poll_us", "far_progress_spin_us", "far_progress_poll_us", "drive_pause_us",
        "far_drive_pause_us", "far_read_pause_us", "far_stream_poll_us",
    }
)  # fmt: skip


def check_params(params: Mapping[str, Any], backend: str = "ucx") -> None:
    """Refuse (``InvalidParameter``) pacing parameters out of range: the microsecond ones must lie in [0, 1000000],
    the READ cork's row counts (and recycle_after_departed) be whole numbers >= 0."""
    for key in (
        "progress_spin_us", "progress_poll_us", "far_progress_spin_us", "far_progress_poll_us", "drive_pause_us",
        "far_drive_pause_us", "far_read_pause_us", "far_stream_poll_us",
    ):  # fmt: skip
        us = params[key]
        if isinstance(us, bool) or not isinstance(us, (int, float)) or not 0 <= us <= 1_000_000:
            raise InvalidParameter(
                f"{key} must be a number of microseconds in [0, 1000000], got {us!r}", backend=backend
            )
    for key in ("far_read_cork_rows", "far_read_cork_push", "far_stream_poll_bytes", "recycle_after_departed"):
        rows = params[key]
        if type(rows) is not int or not 0 <= rows <= 1 << 40:
            raise InvalidParameter(f"{key} must be a whole number in [0, 2**40], got {rows!r}", backend=backend)
