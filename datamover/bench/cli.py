"""`datamover bench`: the throughput sweep from the command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from ..backends import backend_status
from ..units import parse_size, size_text
from .runner import failure_text, format_table, machine_info, run_sweep
from .workload import WORKLOADS, workload_class

DEFAULT_BLOCKS = "4K,64K,1M,16M,64M"
DEFAULT_BATCHES = "1,64,4096"
#: which backend carries each path of a model-shaped run
MODEL_PATHS = {"offload (DRAM <-> FILE)": "posix", "PD (DRAM -> remote DRAM)": "ucx"}
#: the ops a workload may time (LOOKUP: the mooncake workload's pool existence checks)
OPS = ("WRITE", "READ", "LOOKUP")


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput sweep: block size x batch, ours beside the raw library")
    p.add_argument(
        "--backend",
        default="all",
        help="comma-separated backends, or 'all' for every usable one with a workload (default)",
    )
    p.add_argument(
        "--op", default=None, help="comma-separated WRITE, READ, LOOKUP (default: what each backend supports)"
    )
    p.add_argument("--block-sizes", default=DEFAULT_BLOCKS, help=f"comma-separated sizes (default {DEFAULT_BLOCKS})")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCHES, help=f"comma-separated (default {DEFAULT_BATCHES})")
    p.add_argument("--max-bytes", default="256M", help="skip cases moving more than this per transfer")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per case and side")
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--check", action="store_true", help="verify every byte after the timed runs")
    p.add_argument("--json", metavar="PATH", help="write results, machine, versions and settings as JSON")
    p.add_argument("--csv", metavar="PATH", help="write results as CSV (machine, versions, settings in # lines)")
    p.add_argument("--plot", metavar="PNG", help="draw GB/s against block size per backend (and per library)")
    p.add_argument("--dir", help="directory for benchmark files (posix); default the temp dir")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="BACKEND.KEY=VALUE",
        help="a backend parameter for our side, e.g. posix.aio=false or posix.threads=8 (repeatable)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    vs = p.add_argument_group("head to head (--vs nixl)")
    vs.add_argument("--vs", choices=["nixl"], help="also run every case through NIXL on the same memory and files")
    vs.add_argument(
        "--ucx-tls",
        default=os.environ.get("UCX_TLS") or "self,sm,tcp",
        help="UCX_TLS pinned for both libraries (default: $UCX_TLS, else self,sm,tcp)",
    )
    vs.add_argument(
        "--nixl-ucx-err-mode",
        choices=["none", "peer"],
        default="none",
        help="NIXL UCX backend's ucx_error_handling_mode (default none)",
    )
    vs.add_argument(
        "--nixl-posix-queue",
        choices=["aio", "uring", "posixaio"],
        default="aio",
        help="NIXL POSIX backend's I/O queue (default aio: libaio)",
    )
    vs.add_argument(
        "--ucx-peer-host",
        action="store_true",
        help="run the ucx workload's targets (ours and NIXL's) on a second test host: its own network and pid "
        "namespace, reached over a veth pair, so the transfer crosses a network stack (needs root)",
    )
    vs.add_argument(
        "--pin-hosts",
        action="store_true",
        help="with --ucx-peer-host: split this machine's CPUs between the two test hosts (the initiator on one "
        "share, both targets on the other), as two machines would be, instead of the hosts sharing every core",
    )
    m = p.add_argument_group("model-shaped blocks (--model)")
    m.add_argument("--model", help="built-in model name or a YAML/JSON shape file (Hugging Face config.json works)")
    m.add_argument("--isl", type=int, default=4096, help="input sequence length in tokens (default 4096)")
    m.add_argument("--page-tokens", type=int, default=16, help="tokens per KV page (default 16)")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; sizes are per rank (default 1)")
    m.add_argument("--layout", choices=["block", "layer"], default="layer", help="one block per page, or per layer")
    m.add_argument("--list-models", action="store_true", help="print the built-in model shapes and exit")
    p.set_defaults(func=cmd_bench)


def parse_param(text: str) -> tuple[str, str, object]:
    """'posix.aio=false' -> ('posix', 'aio', False); values are read as YAML scalars (numbers, booleans)."""
    import yaml

    name, sep, value = text.partition("=")
    backend, dot, key = name.partition(".")
    if not (sep and dot and backend and key):
        raise SystemExit(f"datamover bench: --param wants BACKEND.KEY=VALUE, got {text!r}")
    return backend.strip(), key.strip(), yaml.safe_load(value)


def selected_backends(spec: str) -> tuple[list[str], list[str]]:
    """(backends to run, skipped with reasons) for a --backend value."""
    names = list(WORKLOADS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    run, skipped = [], []
    for name in names:
        if name not in WORKLOADS:
            raise SystemExit(f"datamover bench: no workload for backend {name!r}; known: {', '.join(WORKLOADS)}")
        ok, reason = backend_status(name)
        if ok:
            run.append(name)
        else:
            skipped.append(f"{name}: {reason}")
    return run, skipped


def _model_points(args, max_bytes: int) -> tuple[list[str], dict, dict, list[str], list[str]]:
    """Backends, exact (block, batch) points and labels for --model; plus lines to print and skipped paths."""
    from .models import ModelShapeError, kv_plan, load_model

    try:
        plan = kv_plan(load_model(args.model), args.isl, args.page_tokens, args.tp, args.layout)
    except ModelShapeError as exc:
        raise SystemExit(f"datamover bench: {exc}") from None
    wanted = list(MODEL_PATHS.values()) if args.backend == "all" else args.backend.split(",")
    backends, skipped = selected_backends(",".join(wanted))
    batch = plan.blocks
    lines = [f"model: {plan.describe()}"]
    if plan.total_bytes > max_bytes:
        batch = max(1, max_bytes // plan.block_bytes)
        lines.append(
            f"  a request is {size_text(plan.total_bytes)}; each transfer moves {batch} of its {plan.blocks} blocks "
            f"({size_text(batch * plan.block_bytes)}) to stay within --max-bytes {size_text(max_bytes)}"
        )
    if plan.block_bytes > max_bytes:
        raise SystemExit(f"datamover bench: one block ({plan.block_bytes} B) exceeds --max-bytes; raise it")
    for path, backend in MODEL_PATHS.items():
        if backend in backends:
            lines.append(f"  {path}: {backend}")
    points = {b: [(plan.block_bytes, batch)] for b in backends}
    labels = dict.fromkeys(backends, plan.label())
    return backends, points, labels, lines, skipped


def cmd_bench(args: argparse.Namespace) -> int:
    if args.list_models:
        from .models import MODELS, kv_plan

        print(f"per request of {args.isl} tokens, pages of {args.page_tokens}, tp={args.tp}, layout={args.layout}:")
        for name, m in MODELS.items():
            p = kv_plan(m, args.isl, args.page_tokens, args.tp, args.layout)
            kv = f"MLA latent {m.mla_dim}" if m.mla_dim else f"{m.kv_heads} KV heads x {m.head_dim}"
            print(
                f"  {name:<15} {m.layers:>3} layers, {kv:<19} {m.dtype:<5} -> {p.blocks:>7} blocks of "
                f"{size_text(p.block_bytes):>8} ({p.total_bytes / (1 << 20):.0f} MiB)"
            )
        return 0
    if args.pin_hosts and not args.ucx_peer_host:
        print("datamover bench --pin-hosts: only with --ucx-peer-host (it pins the two test hosts)", file=sys.stderr)
        return 2
    from .output import writable

    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path and not writable(path):
            print(f"datamover bench: {flag} {path}: its directory is missing or not writable", file=sys.stderr)
            return 2  # said before the sweep runs, not after it
    max_bytes = parse_size(args.max_bytes, "--max-bytes")
    points = labels = None
    model_lines: list[str] = []
    if args.model:
        backends, points, labels, model_lines, skipped = _model_points(args, max_bytes)
    else:
        backends, skipped = selected_backends(args.backend)
        if args.block_sizes == DEFAULT_BLOCKS and args.batch_sizes == DEFAULT_BATCHES:
            # a backend whose default grid would take too long (s3: 4096 objects per case) names its own points
            points = {b: p for b in backends if (p := getattr(workload_class(b), "default_points", None))} or None
    if not backends:
        print("no usable backend to benchmark:\n  " + "\n  ".join(skipped), file=sys.stderr)
        return 1
    blocks = [parse_size(s, "--block-sizes") for s in args.block_sizes.split(",")]
    try:
        batches = [int(s) for s in args.batch_sizes.split(",")]
    except ValueError:
        raise SystemExit(f"datamover bench: --batch-sizes wants whole numbers, got {args.batch_sizes!r}") from None
    if min(blocks) < 1 or min(batches) < 1:
        raise SystemExit("datamover bench: block and batch sizes must be at least 1")
    ops = [o.strip().upper() for o in args.op.split(",")] if args.op else None
    unknown_ops = [o for o in ops or () if o not in OPS]
    if unknown_ops:
        print(f"datamover bench: unknown --op {', '.join(unknown_ops)}; ops are {', '.join(OPS)}", file=sys.stderr)
        return 2
    options: dict = {"posix": {"dir": args.dir}} if args.dir else {}
    for backend, key, value in (parse_param(text) for text in args.param):
        if backend not in backends:
            print(
                f"datamover bench: --param {backend}.{key}: backend {backend!r} is not benchmarked in this run "
                f"({', '.join(backends)})",
                file=sys.stderr,
            )
            return 2
        options.setdefault(backend, {}).setdefault(backend, {})[key] = value
    if ops:
        for backend in list(backends):
            has = workload_class(backend).ops
            lacks = [o for o in ops if o not in has]
            if lacks:
                skip = len(lacks) == len(ops)
                print(
                    f"datamover bench: {backend} does not support {' or '.join(lacks)} (its ops: {', '.join(has)})"
                    + ("; skipped" if skip else ""),
                    file=sys.stderr,
                )
                if skip:
                    backends.remove(backend)
        if not backends:
            return 2
    settings = None
    if args.vs == "nixl":
        from .nixl_api import NixlSettings, nixl_status

        ok, reason = nixl_status()
        if not ok:
            print(f"datamover bench --vs nixl: {reason}", file=sys.stderr)
            return 1
        settings = NixlSettings(
            ucx_tls=args.ucx_tls, ucx_err_mode=args.nixl_ucx_err_mode, posix_queue=args.nixl_posix_queue
        )
    try:
        with stop_on_signals():
            return _run(args, backends, skipped, blocks, batches, ops, options, settings, max_bytes, points, labels,
                        model_lines)  # fmt: skip
    except Stopped as exc:
        name = signal.Signals(exc.signum).name
        print(f"datamover bench: stopped by {name}; the services and processes it started are stopped", file=sys.stderr)
        return 128 + exc.signum


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived: raised in the main thread, so that every ``finally`` and ``with`` on the way
    out stops what it started (services, peer processes, test hosts, files)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into ``Stopped`` for the block. Python's default SIGTERM and SIGHUP end the
    process at once, leaving its services (moto_server, mooncake_master) running and its files behind. The first
    signal raises; later ones are ignored, so that the cleanup it started is not cut short. A signal this process
    was started ignoring (``nohup``, a shell's background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    before = {s: signal.signal(s, stop) for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _run(args, backends, skipped, blocks, batches, ops, options, settings, max_bytes, points, labels,
         model_lines) -> int:  # fmt: skip
    """Make the test hosts ``--ucx-peer-host`` asks for, then run the sweep; the exit code."""
    with contextlib.ExitStack() as stack:
        if args.ucx_peer_host:
            from ..testing.hosts import TestHosts, TestHostsUnavailable

            try:
                # before this process makes any UCX connection: UCX reads the routing table once per process
                hosts = stack.enter_context(TestHosts(2, cpus="split" if args.pin_hosts else None))
            except TestHostsUnavailable as exc:
                print(f"datamover bench --ucx-peer-host: {exc}", file=sys.stderr)
                return 1
            options.setdefault("ucx", {})["test_hosts"] = hosts
            # UCX here (ours, raw ucxx, NIXL's initiator) uses host 0's veth; the hosts' processes have theirs
            stack.enter_context(_env({"UCX_NET_DEVICES": hosts[0].ifname}))
            print(f"ucx targets on test host {hosts[1].name} ({hosts[1].address}), initiator on {hosts[0].address}")
            if args.pin_hosts:
                hosts[0].pin_here()
                cpus = f"initiator {list(hosts[0].cpus)}, targets {list(hosts[1].cpus)}"
                print(f"hosts pinned to CPUs of their own: {cpus}")
        return _sweep(args, backends, skipped, blocks, batches, ops, options, settings, max_bytes, points, labels,
                      model_lines)  # fmt: skip


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """``values`` in os.environ for the block (UCX here and in the processes started meanwhile reads them)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sweep(args, backends, skipped, blocks, batches, ops, options, settings, max_bytes, points, labels,
           model_lines) -> int:  # fmt: skip
    """Run the sweep ``cmd_bench`` set up, print and write its results; the exit code."""
    if settings is not None:
        from .nixl_api import nixl_versions, ucx_modules
    headers: dict[str, dict] = {}
    failures: list[dict] = []
    info = machine_info()
    print(f"datamover bench on {info['platform']}, {info['cpus']} CPUs ({info['cpu_model']}), python {info['python']}")
    if settings is not None:
        print(
            f"  vs nixl {nixl_versions()}: UCX_TLS={settings.ucx_tls}, NIXL ucx_error_handling_mode="
            f"{settings.ucx_err_mode}, NIXL POSIX queue={settings.posix_queue}, NIXL progress thread=off, "
            f"NIXL's UCX_MODULES={ucx_modules()}"
        )
    for line in model_lines:
        print(line)
    for line in skipped:
        print(f"  skipped {line}")
    with settings.pinned_env() if settings is not None else contextlib.nullcontext():
        results = run_sweep(
            backends,
            ops,
            blocks,
            batches,
            max_bytes=max_bytes,
            min_time=args.min_time,
            max_iters=args.max_iters,
            check=args.check,
            options=options,
            progress=not args.quiet,
            headers=headers,
            points=points,
            labels=labels,
            vs=args.vs,
            vs_settings=settings,
            failures=failures,
        )
    for name, head in headers.items():
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in head.items()))
    print(format_table(results))
    for backend in dict.fromkeys(r.backend for r in results):
        summary = getattr(workload_class(backend), "summary", None)  # a workload's own verdicts, if it has any
        if summary is not None:
            for line in summary([r for r in results if r.backend == backend], headers.get(backend, {})):
                print(line)
    if args.json or args.csv or args.plot:
        from . import output

        payload = output.report(results, info, vars(args) | {"func": None}, headers, skipped, failures)
        if args.json:
            output.write_json(args.json, payload)
        if args.csv:
            output.write_csv(args.csv, payload)
        if args.plot:
            title = f"datamover{' vs NIXL' if args.vs else ''} on {info['cpus']} CPUs, {info['cpu_model']}"
            output.plot(args.plot, results, title=(labels and next(iter(labels.values()), "")) or title)
    for f in failures:
        print(f"datamover bench: {failure_text(f)}", file=sys.stderr)
    if args.check and any(r.checked is False or r.vs_checked is False for r in results):
        print("byte check FAILED", file=sys.stderr)
        return 2
    return 1 if failures else 0
