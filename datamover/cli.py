"""The `datamover` command: info, bench, and the subcommands later layers add."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from . import __version__
from .backends import backend_names, backend_status, get_backend_class
from .errors import ConfigError, DatamoverError, InvalidParameter, UnknownBackend


def backend_report() -> list[dict]:
    """Every known backend: usable here or not (and why), and what it moves."""
    rows = []
    for name in backend_names():
        ok, reason = backend_status(name)
        try:
            cls = get_backend_class(name)
            pairs = sorted(f"{a.value}<->{b.value}" for a, b in cls.pairs)
            scope = [s for s, on in (("local", cls.supports_local), ("remote", cls.supports_remote)) if on]
            details = cls.environment()
        except Exception:
            pairs, scope, details = [], [], {}
        rows.append(
            {"backend": name, "usable": ok, "reason": reason, "moves": pairs, "scope": scope, "details": details}
        )
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    rows = backend_report()
    if args.json:
        print(json.dumps({"version": __version__, "backends": rows}, indent=2))
        return 0
    print(f"datamover {__version__}")
    width = max(len(r["backend"]) for r in rows)
    for r in rows:
        mark = "yes" if r["usable"] else "no "
        moves = ", ".join(r["moves"])
        print(f"  {r['backend']:<{width}}  usable: {mark}  moves: {moves} ({'/'.join(r['scope'])})")
        print(f"  {'':<{width}}  {r['reason']}")
        for key, value in r["details"].items():
            print(f"  {'':<{width}}  {key}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="datamover", description=__doc__)
    parser.add_argument("--version", action="version", version=f"datamover {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="list backends, whether each is usable here, and why not")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    # these need the policy extra (pyyaml); their parsers load only when they run
    _delegate(sub, "replay", "datamover.policy.cli", "replay a Mooncake-format trace through the tier policy")
    _delegate(sub, "tracegen", "datamover.policy.tracegen", "write a seeded synthetic trace in Mooncake's format")
    _delegate(sub, "alerts", "datamover.policy.alerts_cli", "write Prometheus alerting rules from a tier config")
    _delegate(sub, "nixl-run", "datamover.compat.nixl.alias", "run a NIXL program unchanged: import nixl is datamover")
    return parser


def _delegate(sub, name: str, module: str, help_text: str) -> None:
    """A subcommand whose own parser lives in ``module.main(argv)``, imported only when it runs."""
    p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: importlib.import_module(module).main(args.argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; bad input (a parameter, a config, a file that cannot be opened) is one line and exit
    code 2, not a traceback (a failure past the input keeps its traceback)."""
    args = build_parser().parse_args(argv)
    if args.command == "nixl-run":  # the program's own errors keep their tracebacks
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except (InvalidParameter, ConfigError, UnknownBackend) as exc:
        print(f"datamover {args.command}: {exc}", file=sys.stderr)
    except OSError as exc:
        if exc.filename is None or isinstance(exc, DatamoverError):
            raise
        print(f"datamover {args.command}: {exc.strerror}: {exc.filename}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
