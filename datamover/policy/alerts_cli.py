"""`datamover alerts`: read a tier config and write the Prometheus alerting rules of its `burn_rate_alerts`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import ConfigError
from ..telemetry.alerts import alerts_yaml
from .config import load_config


def add_alerts_parser(sub: argparse._SubParsersAction) -> None:
    """Add `alerts` to a subcommand parser (datamover/cli.py wires it in)."""
    p = sub.add_parser("alerts", help="write Prometheus alerting rules from the config's burn_rate_alerts")
    p.add_argument("--config", help="tier config YAML (default: the documented defaults)")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_alerts)


def cmd_alerts(args: argparse.Namespace) -> int:
    """Write the rules file the arguments ask for."""
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"datamover alerts: {exc}", file=sys.stderr)
        return 2
    text = alerts_yaml(config.observability.burn_rate_alerts)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m datamover.policy.alerts_cli [--config FILE] [-o OUT]`."""
    parser = argparse.ArgumentParser(
        prog="datamover", description="write Prometheus alerting rules from a tier config's burn_rate_alerts"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_alerts_parser(sub)
    args = parser.parse_args(["alerts", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
