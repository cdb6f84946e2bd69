"""Prefill/decode disaggregation: prefill writes each request's KV blocks into decode's paged cache over UCX.

Two processes, started here:

- decode owns a paged KV cache ``[layers, blocks, block_tokens, kv_heads,
  head_dim]`` (a torch tensor; CUDA when present, CPU otherwise), registers
  it, publishes its metadata (etcd under a lease when an etcd server is
  available, else its TCP side channel), and for every request assigns free
  block ids and tells prefill which, in a notification;
- prefill "computes" the request's KV (deterministic random tensors) into
  its own pages, then writes it layer by layer straight into the block ids
  decode assigned, one notification per layer and one at the end;
- decode waits for the notifications, checks every byte against what
  prefill must have computed, and reports per-request latency and GB/s.

Run: ``python examples/pd_disaggregation.py [--requests 8] [--exchange etcd|tcp]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

UCX = {"backends": {"ucx": {}}}


def kv_cache(args, torch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (args.layers, args.blocks, args.block_tokens, args.kv_heads, args.head_dim)
    return torch.zeros(shape, dtype=torch.float16, device=device)


def computed_kv(req: int, layer: int, nblocks: int, args, torch):
    """What prefill computes for (request, layer): deterministic random bits, so decode can check every byte."""
    shape = (nblocks, args.block_tokens, args.kv_heads, args.head_dim)
    raw = np.random.default_rng(req * 1000 + layer).bytes(2 * int(np.prod(shape)))
    return torch.frombuffer(bytearray(raw), dtype=torch.float16).reshape(shape)


def block_descs(cache, layer: int, block_ids: np.ndarray):
    """One descriptor per block of one layer: the blocks are contiguous runs inside the cache tensor."""
    from datamover import DescList, MemType

    block_bytes = cache[0, 0].numel() * cache.element_size()
    base = cache.data_ptr() + layer * cache.shape[1] * block_bytes
    mem = MemType.VRAM if cache.is_cuda else MemType.DRAM
    dev = (cache.device.index or 0) if cache.is_cuda else 0
    return DescList.from_columns(base + block_ids.astype(np.int64) * block_bytes, block_bytes, dev, mem)


def connect(agent, peer: str, args, addresses) -> None:
    """Load the peer's metadata: from etcd (waiting for it to appear) or from its side channel."""
    if args.exchange == "etcd":
        agent.fetch_remote(peer, etcd=args.etcd, namespace="pd-example", timeout=30)
    else:
        host, port = addresses.get()
        agent.fetch_remote(host, port)


def publish(agent, args, addresses) -> None:
    if args.exchange == "etcd":
        agent.publish(args.etcd, namespace="pd-example", ttl=5)
    else:
        addresses.put(agent.listen_address)


def decode_main(args, requests, my_addr, peer_addr, results) -> None:
    import torch

    from datamover import Agent

    with Agent("decode-0", UCX, listen_port=0 if args.exchange == "tcp" else None) as agent:
        cache = kv_cache(args, torch)
        agent.register_memory(cache)
        publish(agent, args, my_addr)
        connect(agent, "prefill-0", args, peer_addr)
        free = list(range(args.blocks))
        rng = np.random.default_rng(0)
        for req, nblocks in requests:
            ids = np.array(sorted(rng.choice(free, nblocks, replace=False)), dtype=np.int64)
            free = [b for b in free if b not in set(ids.tolist())]
            t0 = time.perf_counter()
            agent.send_notification("prefill-0", f"alloc:{req}:".encode() + ids.tobytes())
            for layer in range(args.layers):
                agent.wait_notification(f"req-{req}:layer-{layer}".encode(), timeout=60, peer="prefill-0")
            _, done = agent.wait_notification(f"req-{req}:done".encode(), timeout=60, peer="prefill-0")
            latency = time.perf_counter() - t0
            xfer_s = float(done.rsplit(b":", 1)[1])
            got = cache[:, torch.as_tensor(ids, device=cache.device)].cpu()
            want = torch.stack([computed_kv(req, layer, nblocks, args, torch) for layer in range(args.layers)])
            ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
            nbytes = got.numel() * got.element_size()
            results.put((req, nblocks, nbytes, latency, xfer_s, ok))
            free += ids.tolist()  # the request finished decoding; its blocks go back to the pool
        agent.send_notification("prefill-0", b"bye")
        agent.wait_notification(b"bye", timeout=30)


def prefill_main(args, my_addr, peer_addr) -> None:
    import torch

    from datamover import Agent

    with Agent("prefill-0", UCX, listen_port=0 if args.exchange == "tcp" else None) as agent:
        cache = kv_cache(args, torch)
        agent.register_memory(cache)
        publish(agent, args, my_addr)
        connect(agent, "decode-0", args, peer_addr)
        while True:
            _, msg = agent.wait_notification(b"", timeout=120, peer="decode-0")
            if msg == b"bye":
                agent.send_notification("decode-0", b"bye")
                return
            _, req, raw = msg.split(b":", 2)
            remote_ids = np.frombuffer(raw, dtype=np.int64)
            local_ids = np.arange(remote_ids.shape[0], dtype=np.int64)
            # the forward pass: this request's KV, layer by layer, into our own pages
            for layer in range(args.layers):
                kv = computed_kv(int(req), layer, len(local_ids), args, torch)
                cache[layer, : len(local_ids)] = kv.to(cache.device)
            if cache.is_cuda:
                torch.cuda.synchronize()
            # ship it layer by layer, each layer with its own notification, all in flight together
            started = time.perf_counter()
            xfers = [
                agent.transfer(
                    "WRITE",
                    block_descs(cache, layer, local_ids),
                    block_descs_remote(args, layer, remote_ids, agent),
                    agent="decode-0",
                    notify=f"req-{req.decode()}:layer-{layer}".encode(),
                )
                for layer in range(args.layers)
            ]
            for x in xfers:
                x.wait()
                x.release()
            elapsed = time.perf_counter() - started  # first layer posted -> last layer landed
            agent.send_notification("decode-0", f"req-{req.decode()}:done:{elapsed:.6f}".encode())


def block_descs_remote(args, layer: int, block_ids: np.ndarray, agent):
    """Descriptors into decode's cache, from the region its metadata advertises (the cache is its only region)."""
    from datamover import DescList

    meta = agent.remote_metadata("decode-0")
    mem, dev, start, length, _ = meta.regions[0]
    block_bytes = length // (args.layers * args.blocks)
    base = start + layer * args.blocks * block_bytes
    return DescList.from_columns(base + block_ids * block_bytes, block_bytes, dev, mem)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=256, help="pages in each cache")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--exchange", choices=["auto", "etcd", "tcp"], default="auto")
    p.add_argument("--etcd", help="etcd endpoint (default: start one on loopback when etcd is installed)")
    args = p.parse_args(argv)

    server = None
    if args.exchange in ("auto", "etcd") and not args.etcd:
        from datamover.testing.services import EtcdServer, etcd_binary

        if etcd_binary() is not None:
            server = EtcdServer()
            args.etcd = server.endpoint
        elif args.exchange == "etcd":
            print("etcd is not installed; use --exchange tcp or --etcd URL", file=sys.stderr)
            return 2
    if args.exchange == "auto":
        args.exchange = "etcd" if args.etcd else "tcp"

    rng = np.random.default_rng(1)
    requests = [(r, int(rng.integers(4, args.blocks // 4))) for r in range(args.requests)]
    ctx = mp.get_context("spawn")
    to_decode, to_prefill, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    decode = ctx.Process(target=decode_main, args=(args, requests, to_prefill, to_decode, results))
    prefill = ctx.Process(target=prefill_main, args=(args, to_decode, to_prefill))
    decode.start()
    prefill.start()
    failed = False
    try:
        block_bytes = args.block_tokens * args.kv_heads * args.head_dim * 2
        print(
            f"PD disaggregation over ucx, metadata via {args.exchange}: {args.layers} layers, "
            f"{args.blocks} blocks of {block_bytes} B per layer"
        )
        print("latency: decode assigns blocks -> last notification; GB/s: bytes over the transfer time prefill saw")
        print(f"{'request':>7} {'blocks':>6} {'MiB':>8} {'latency ms':>10} {'xfer ms':>8} {'GB/s':>7} {'bytes':>6}")
        for _ in requests:
            req, nblocks, nbytes, latency, xfer_s, ok = results.get(timeout=180)
            failed |= not ok
            print(
                f"{req:>7} {nblocks:>6} {nbytes / 2**20:8.2f} {latency * 1e3:10.2f} {xfer_s * 1e3:8.2f} "
                f"{nbytes / xfer_s / 1e9:7.2f} {'ok' if ok else 'WRONG':>6}"
            )
        decode.join(60)
        prefill.join(60)
        failed |= decode.exitcode != 0 or prefill.exitcode != 0
    finally:
        for proc in (decode, prefill):
            if proc.is_alive():
                proc.kill()
        if server is not None:
            server.close()
    print("every byte checked" if not failed else "FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
