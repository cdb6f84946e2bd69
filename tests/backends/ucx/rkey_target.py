"""A process that receives packed rkeys the way an initiator does (tests only): check, unpack, one get each.

Two UCX workers (separate contexts, the default transports) and an endpoint from the first to the second, whose
4 KiB registered buffer a real key names. Prints one line (the second worker's address, its real key and buffer
address), then for each hex key on stdin answers one line: ``= refused <reason>`` (RkeyCheck), ``= unusable``
(UCX refused it), or ``= got <n>`` after a one-byte get at the buffer through it, with ``mapped`` when the file
or sysv id given in argv was mapped while the key was held. UCX's own log lines share stdout, hence the ``=``.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from datamover.backends.ucx import rma
from datamover.backends.ucx.address import parse
from datamover.backends.ucx.config import features, import_ucxx, ucx_config
from datamover.backends.ucx.rkeys import RkeyCheck
from datamover.errors import InvalidMetadata, UcpError


def _mapped(names: list[str]) -> bool:
    """Whether this process maps the file or sysv segment id named (what the key's unpacking did)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            f = line.split()
            if len(f) > 5 and (f[5] == names[0] or (f[5].startswith("/SYSV") and f[4] == names[1])):
                return True
    return False


def main() -> None:
    u, _ = import_ucxx()
    ctxs = [u.UCXContext(ucx_config({}, False), feature_flags=features(u)) for _ in range(2)]
    ws = [u.UCXWorker(c) for c in ctxs]
    address = bytes(ws[1].address)
    ep = ws[0].create_endpoint_from_worker_address(ws[1].address, False)
    buf = np.full(4096, 7, np.uint8)
    memh = rma.mem_map(ctxs[1].handle, buf.ctypes.data, buf.nbytes)
    keys = RkeyCheck(parse(address))
    print("=", json.dumps({"address": address.hex(), "key": rma.rkey_pack(ctxs[1].handle, memh).hex(),
                      "addr": buf.ctypes.data}), flush=True)  # fmt: skip
    dst = np.zeros(1, np.uint8)
    for line in sys.stdin:
        key = bytes.fromhex(line.strip())
        try:
            keys.check("the fuzzer", 0, "DRAM", key)
        except InvalidMetadata as exc:
            print("= refused", exc.reason, flush=True)
            continue
        try:
            rkey = rma.rkey_unpack(ep.handle, key)
        except UcpError:
            print("= unusable", flush=True)
            continue
        mapped = _mapped(sys.argv[1:])
        dst[0] = 0
        rma.post_rows(True, ep.handle, [rma.make_row(dst.ctypes.data, 1, buf.ctypes.data, rkey, None)])
        flush = rma.Flush(ep.handle)
        while flush.poll() == rma.UCS_INPROGRESS:
            ws[0].progress()
            ws[1].progress()
        rma.rkey_destroy(rkey)
        print("= got", int(dst[0]), *(["mapped"] if mapped else []), flush=True)


if __name__ == "__main__":
    main()
