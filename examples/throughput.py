"""Throughput of datamover's local backends beside the raw library, through the benchmark API.

    python examples/throughput.py [--backend memcpy,posix] [--block-sizes 64K,1M,16M]

The same sweep as `datamover bench`, driven from Python: useful as a template
for measuring your own block layout.
"""

from __future__ import annotations

import argparse

from datamover.bench import format_table, run_sweep
from datamover.units import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="memcpy,posix")
    parser.add_argument("--block-sizes", default="64K,1M,16M")
    parser.add_argument("--batch-sizes", default="1,64")
    args = parser.parse_args()
    results = run_sweep(
        args.backend.split(","),
        None,
        [parse_size(s) for s in args.block_sizes.split(",")],
        [int(b) for b in args.batch_sizes.split(",")],
        max_bytes=256 << 20,
        check=True,
    )
    print(format_table(results))
    if any(r.checked is False for r in results):
        raise SystemExit("byte check failed")


if __name__ == "__main__":
    main()
