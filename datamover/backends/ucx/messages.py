"""The ucx control protocol's messages: one frozen dataclass per type, parsed strictly off the wire and back.

A frame's msgpack map becomes a message only through ``from_wire``: the map
must name a known type in ``t``, carry every required field with its exact
type (a bool is not an int here, nor an int a bool), and every int, string,
byte string and list must be within its bound, before any handler, C library
or allocation sees a byte of it. Keys a type does not define are ignored (a
newer peer may add optional fields; the frame's size already bounds them).
``to_wire`` gives back the map a peer of any version of this protocol reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ...errors import InvalidMetadata
from .config import UCX_TCP_SEG_DEFAULT, parse_rkeys

MAX_ROWS = 1 << 20  # descriptors in one request
MAX_NOTIFY = 1 << 20
MAX_RKEYS_BYTES = 16 << 20
MAX_ADDRESS = 1 << 16
MAX_NAME = 255
MAX_REASON = 4096
MAX_NONCE = 64
MAX_MAC = 64
MAX_LOCAL = 4096
MAX_INCARNATION = 64
MAX_RKEY_ROWS = 1 << 16
MAX_SEG = 1 << 31
U64 = 1 << 64
OPS = ("WRITE", "READ")

_NONE = type(None)


def _wire(types: tuple[type, ...], bound: int, *, key: str | None = None, default: Any = dataclasses.MISSING) -> Any:
    """A field as it travels: its exact types, its bound (value for ints, length otherwise), its key on the wire."""
    return field(default=default, metadata={"types": types, "bound": bound, "key": key})


class Message:
    """A control message: ``WIRE`` is its ``t``; ``SPEC`` its fields as (attribute, key, types, bound, required)."""

    __slots__ = ()
    WIRE: ClassVar[str]
    SPEC: ClassVar[tuple[tuple[str, str, tuple[type, ...], int, bool], ...]]

    @classmethod
    def from_wire(cls: type[M], wire: dict[Any, Any]) -> M:
        """The message ``wire`` carries, every field checked; InvalidMetadata naming the field otherwise."""
        t = cls.WIRE
        kwargs = {}
        for attr, key, types, bound, required in cls.SPEC:
            if key not in wire:
                if required:
                    raise InvalidMetadata(f"control message {t!r} lacks {key!r}")
                continue
            value = wire[key]
            if type(value) not in types:
                raise InvalidMetadata(f"control message {t!r}: {key!r} is a {type(value).__name__}")
            if type(value) is int:
                if not 0 <= value < bound:
                    raise InvalidMetadata(f"control message {t!r}: {key!r} is out of range")
            elif value is not None and type(value) is not bool and len(value) > bound:
                raise InvalidMetadata(f"control message {t!r}: {key!r} is longer than {bound}")
            kwargs[attr] = value
        msg = cls(**kwargs)
        msg.check()
        return msg

    def check(self) -> None:
        """Checks across fields, or on a field's content, beyond type and bound (raises InvalidMetadata)."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.WIRE}
        for attr, key, _, _, _ in self.SPEC:
            out[key] = getattr(self, attr)
        return out


M = TypeVar("M", bound=Message)
MESSAGES: dict[str, type[Message]] = {}


def message(wire: str) -> Any:
    """Make the class a frozen, slotted dataclass registered as message type ``wire``."""

    def wrap(cls: type[M]) -> type[M]:
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.WIRE = wire
        cls.SPEC = tuple(
            (f.name, f.metadata["key"] or f.name, f.metadata["types"], f.metadata["bound"],
             f.default is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        )  # fmt: skip
        MESSAGES[wire] = cls
        return cls

    return wrap


def from_wire(wire: Any) -> Message:
    """The message a decoded frame carries; InvalidMetadata when it is not a map naming a known type."""
    if not isinstance(wire, dict) or not isinstance(wire.get("t"), str):
        raise InvalidMetadata("control frame must be a map with a string 't' (type)")
    cls = MESSAGES.get(wire["t"])
    if cls is None:
        raise InvalidMetadata(f"unknown control message type {wire['t'][:32]!r}")
    return cls.from_wire(wire)


# -- the handshake ---------------------------------------------------------------------------------------------
@message("challenge")
class Challenge(Message):
    """Target -> initiator, first: the target's nonce (the initiator's MAC covers it)."""

    nonce: bytes = _wire((bytes,), MAX_NONCE)


@message("hello")
class Hello(Message):
    """Initiator -> target: who it is, its UCX worker address, its nonce and (with a secret) its MAC."""

    name: str = _wire((str,), MAX_NAME)
    address: bytes = _wire((bytes,), MAX_ADDRESS)
    nonce: bytes = _wire((bytes,), MAX_NONCE)
    mac: bytes = _wire((bytes,), MAX_MAC, default=b"")
    # the tcp segment it receives (0: no tcp); a peer from before this field keeps UCX's default
    tcp_rx: int = _wire((int,), MAX_SEG, default=UCX_TCP_SEG_DEFAULT)

    def check(self) -> None:
        if not self.name or not self.address:
            raise InvalidMetadata("hello carries no valid name and UCX address")


@message("welcome")
class Welcome(Message):
    """Target -> initiator: the connection id, its current worker address, packed rkeys and cma offer, MAC, and
    which process it is (the ``incarnation`` its connection info names; a peer from before this field sends none)."""

    conn_id: int = _wire((int,), U64)
    address: bytes = _wire((bytes,), MAX_ADDRESS)
    rkeys: bytes = _wire((bytes,), MAX_RKEYS_BYTES, default=b"")
    local: bytes = _wire((bytes,), MAX_LOCAL, default=b"")
    mac: bytes = _wire((bytes,), MAX_MAC, default=b"")
    tcp_rx: int = _wire((int,), MAX_SEG, default=UCX_TCP_SEG_DEFAULT)  # as Hello's
    incarnation: bytes = _wire((bytes,), MAX_INCARNATION, default=b"")


@message("error")
class Error(Message):
    """Target -> initiator, then the hang-up: why the connection is refused (``auth``: the shared secret)."""

    reason: str = _wire((str,), MAX_REASON, default="")
    auth: bool = _wire((bool,), 1, default=False)


# -- after the handshake, either way ---------------------------------------------------------------------------
@message("notif")
class Notif(Message):
    """A notification for the other agent."""

    msg: bytes = _wire((bytes,), MAX_NOTIFY)


# -- target -> initiator ----------------------------------------------------------------------------------------
@message("rkeys")
class Rkeys(Message):
    """Regions newly mapped for one-sided access: ``[[id, mem, dev, addr, length, rkey], ...]``."""

    add: list = _wire((list,), MAX_RKEY_ROWS)

    def check(self) -> None:
        parse_rkeys("the target", self.add)


@message("revoke")
class Revoke(Message):
    """A region the target is deregistering: drop its rkey, then confirm with ``revoked``."""

    id: int = _wire((int,), U64)


@message("refuse")
class Refuse(Message):
    """A request the target will not serve; ``row`` the offending descriptor when one is to blame."""

    id: int = _wire((int,), U64)
    reason: str = _wire((str,), MAX_REASON)
    row: int | None = _wire((int, _NONE), U64, default=None)


@message("done")
class Done(Message):
    """A served WRITE has landed in the target's memory."""

    id: int = _wire((int,), U64)


@message("fail")
class Fail(Message):
    """A request the target accepted but could not finish."""

    id: int = _wire((int,), U64)
    reason: str = _wire((str,), MAX_REASON)


# -- initiator -> target ----------------------------------------------------------------------------------------
@message("revoked")
class Revoked(Message):
    """The initiator dropped the region's rkey and its operations on it have ended."""

    id: int = _wire((int,), U64)


@message("cancel")
class Cancel(Message):
    """The initiator gave up on a request: serve none of it that has not started, send no done."""

    id: int = _wire((int,), U64)


@message("req")
class Req(Message):
    """A request for the owner to serve: the remote descriptors as little-endian int64 columns, the first tag."""

    id: int = _wire((int,), U64)
    op: str = _wire((str,), 8)
    mem: str = _wire((str,), 16)
    addr: bytes = _wire((bytes,), 8 * MAX_ROWS)
    length: bytes = _wire((bytes,), 8 * MAX_ROWS, key="len")
    dev: bytes = _wire((bytes,), 8 * MAX_ROWS)
    tag: int = _wire((int,), U64)
    notify: bytes | None = _wire((bytes, _NONE), MAX_NOTIFY, default=None)

    def check(self) -> None:
        if self.op not in OPS:
            raise InvalidMetadata(f"control message 'req': unknown op {self.op[:8]!r}")
        n = len(self.addr)
        if n % 8 or len(self.length) != n or len(self.dev) != n:
            raise InvalidMetadata("control message 'req': descriptor columns must be equal-length int64 arrays")
        if self.tag + self.rows > U64:  # each row takes the next tag: the last must fit 64 bits
            raise InvalidMetadata(f"control message 'req': 'tag' {self.tag} + {self.rows} rows passes 2**64")

    @property
    def rows(self) -> int:
        return len(self.addr) // 8
