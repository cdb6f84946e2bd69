"""The s3 backend's parameters and their defaults (``S3Backend.default_params``), one comment each, and the checks that
refuse a bad one when the backend is made, naming it, rather than with an untyped error from botocore later."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...errors import InvalidParameter
from ...units import MiB

DEFAULT_PARAMS: dict[str, Any] = {
    # where and who: None falls back to AWS_* environment variables and ~/.aws/{config,credentials}
    "endpoint_url": None,
    "region": None,
    "profile": None,
    "access_key_id": None,
    "secret_access_key": None,
    "session_token": None,
    "addressing_style": "auto",  # "path", "virtual" or "auto"
    "verify_tls": True,  # or a CA bundle path
    # how fast
    "concurrency": 16,
    "multipart_threshold": 16 * MiB,  # objects larger than this go as multipart uploads
    "part_size": 8 * MiB,
    "read_part_size": 8 * MiB,  # reads longer than this are split into parallel ranged GETs
    # how hard to try
    # botocore's "legacy", "standard" or "adaptive", and attempts in all; None: AWS_RETRY_MODE,
    # AWS_MAX_ATTEMPTS or the profile's retry_mode / max_attempts, else standard with 5 attempts
    "retry_mode": None,
    "max_attempts": None,
    "connect_timeout": 5.0,
    "read_timeout": 60.0,
    # integrity
    "native_checksum": "auto",  # send x-amz-checksum-crc32c: True, False, or "auto" (drop it if refused)
    "require_checksum": True,  # a whole-object read of an object without our CRC32C fails
}
LOOSE_PARAMS = frozenset({"verify_tls"})  # True, False or a CA bundle path

_MIN_PART = 5 * MiB  # S3's smallest non-final multipart part
#: what botocore accepts as a region name
_REGION = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?")


def check_params(p: Mapping[str, Any]) -> None:
    """Refuse, naming the parameter, what S3 or this backend cannot take (part sizes, spellings), and what botocore or
    the pool would refuse later with an untyped error."""
    from urllib.parse import urlsplit

    if int(p["part_size"]) < _MIN_PART:
        raise InvalidParameter(f"part_size must be >= 5 MiB (S3's minimum part), got {p['part_size']}", backend="s3")
    if int(p["multipart_threshold"]) < int(p["part_size"]):
        raise InvalidParameter("multipart_threshold must be >= part_size", backend="s3")
    if p["addressing_style"] not in ("auto", "path", "virtual"):
        style = p["addressing_style"]
        raise InvalidParameter(f"addressing_style must be auto, path or virtual, got {style!r}", backend="s3")
    if p["native_checksum"] not in (True, False, "auto"):
        native = p["native_checksum"]
        raise InvalidParameter(f"native_checksum must be True, False or 'auto', got {native!r}", backend="s3")
    for name, bound in (("concurrency", "an integer >= 1"), ("max_attempts", "an integer >= 1"),
                        ("connect_timeout", "seconds > 0"), ("read_timeout", "seconds > 0")):  # fmt: skip
        value = p[name]
        if value is None and name == "max_attempts":
            continue
        try:
            ok = int(value) >= 1 if bound.startswith("an integer") else float(value) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidParameter(f"{name} must be {bound}, got {value!r}", backend="s3")
    url = p["endpoint_url"]
    if url is not None:
        try:
            parts = urlsplit(url) if isinstance(url, str) else None
            ok = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:
            ok = False
        if not ok:
            raise InvalidParameter(f"endpoint_url must be an http(s)://host[:port] URL, got {url!r}", backend="s3")
    region = p["region"]
    if region is not None and not (isinstance(region, str) and _REGION.fullmatch(region)):
        raise InvalidParameter(f"region must be a region name such as 'us-east-1', got {region!r}", backend="s3")
