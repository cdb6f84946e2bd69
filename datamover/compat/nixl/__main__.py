"""``python -m datamover.compat.nixl PROGRAM [ARGS]``: run a NIXL program unchanged on datamover."""

from __future__ import annotations

import sys

from .alias import run

if __name__ == "__main__":
    run(sys.argv[1:])
