"""The check every limits section of an agent config (``extra[...]``) shares."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from ..errors import InvalidParameter, shown


def check_limits(section: str, limits: Any) -> None:
    """Each field of a limits dataclass (config ``extra[section]``) is a positive number of its default's type:
    an integer (not a bool) or a finite number of seconds; else InvalidParameter naming it (a string deadline
    failed every side-channel connection, a zero bound refused them all)."""
    for f in fields(limits):
        value = getattr(limits, f.name)
        whole = isinstance(f.default, int)
        ok = type(value) is int if whole else type(value) in (int, float) and math.isfinite(value)
        if not ok or value <= 0:
            kind = "a positive integer" if whole else "a positive finite number"
            raise InvalidParameter(f"config extra '{section}' limit {f.name!r} must be {kind}, got {shown(value)}")
