"""NIXL's descriptor lists (``nixlXferDList``, ``nixlRegDList``, ``nixlRemoteDList``) over datamover's DescList."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...descriptors import DescList
from ...errors import InvalidDescriptor
from ._errors import nixlInvalidParamError, nixlNotFoundError, translate
from ._types import as_bytes, as_name, mem_of, nixl_mem_t, seg_of

#: the dtypes NIXL's bindings take an Nx3 array in (native byte order)
_ARRAY_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64))
_FIELDS = ("addr", "len", "devId")


class DescriptorInputError(nixlInvalidParamError):
    """Descriptors NIXL refuses, raised as a nixlInvalidParamError that is also the built-in exception NIXL's API or
    bindings raise for them (its subclasses); ``index`` is the offending descriptor's (None: the input as a whole)."""

    def __init__(self, reason: str, index: int | None = None) -> None:
        self.reason, self.index = reason, index
        super().__init__(reason if index is None else f"descriptor {index}: {reason}")


class DescriptorTypeError(DescriptorInputError, TypeError):
    """Not descriptors at all, or a descriptor that is not a tuple (NIXL: TypeError)."""


class DescriptorValueError(DescriptorInputError, ValueError):
    """A tuple of the wrong width, or an array not Nx3, int64/uint64 and C-contiguous (NIXL: ValueError)."""


class DescriptorFieldError(DescriptorInputError, RuntimeError):
    """A field NIXL's bindings cannot cast: addr/len/devId not an unsigned integer, metaInfo or agent name not str
    or bytes (NIXL: RuntimeError)."""


class NoDescriptorsError(DescriptorInputError, IndexError):
    """An empty list, array or tensor where NIXL reads the first descriptor (NIXL: IndexError)."""


def tuple_rows(descs: Sequence, width: int) -> np.ndarray:
    """(N, 3) int64 rows from tuples of ``width`` fields (addr, len, devId, then metaInfo or an agent name), refused
    as NIXL's bindings refuse them, at the first bad descriptor: a non-tuple (TypeError), another width
    (ValueError), a field that does not cast (RuntimeError). Fields at or over 2**63 are refused too (datamover keeps
    them as int64; NIXL takes them up to 2**64-1)."""
    if not descs:
        return np.zeros((0, 3), dtype=np.int64)
    fast = all(type(d) is tuple and len(d) == width for d in descs) and all(
        type(v) is int for d in descs for v in d[:3]
    )
    if fast:
        try:
            rows = np.array([d[:3] for d in descs], dtype=np.int64).reshape(-1, 3)
        except OverflowError:
            rows = None
        if rows is not None and (rows >= 0).all():
            if width == 4:
                for i, d in enumerate(descs):
                    _check_text(d[3], i)
            return rows
    return _checked_rows(descs, width)


def _checked_rows(descs: Sequence, width: int) -> np.ndarray:
    rows = np.zeros((len(descs), 3), dtype=np.int64)
    for i, d in enumerate(descs):
        if not isinstance(d, tuple):
            raise DescriptorTypeError(f"a {type(d).__name__}, not a tuple: each descriptor must be a tuple", i)
        if len(d) != width:
            raise DescriptorValueError(f"{len(d)} fields: each descriptor tuple must have exactly {width}", i)
        rows[i] = [_field(v, i, name) for v, name in zip(d[:3], _FIELDS)]
        if width == 4:
            _check_text(d[3], i)
    return rows


def _field(value: Any, i: int, name: str) -> int:
    if isinstance(value, (float, np.floating)):
        raise DescriptorFieldError(f"{name} {value!r} is not an integer", i)
    try:
        n = operator.index(value)
    except TypeError:
        raise DescriptorFieldError(f"{name} of type {type(value).__name__} is not an integer", i) from None
    if not 0 <= n < 1 << 64:
        raise DescriptorFieldError(f"{name} {n} is not an unsigned 64-bit integer", i)
    if n >= 1 << 63:
        raise DescriptorFieldError(f"{name} {n} is at or over 2**63, which datamover does not take", i)
    return n


def _check_text(value: Any, i: int) -> None:
    if not isinstance(value, (str, bytes, bytearray)):
        raise DescriptorFieldError(f"a {type(value).__name__} as metaInfo or agent name, not str or bytes", i)


def _array_rows(descs: np.ndarray) -> np.ndarray:
    """An Nx3 array as NIXL's bindings take it: int64 or uint64 in native order, C-contiguous (else ValueError)."""
    if descs.ndim != 2 or descs.shape[1] != 3:
        raise DescriptorValueError(f"an Nx3 array is needed for a descriptor list, got shape {descs.shape}")
    if descs.dtype not in _ARRAY_DTYPES:
        raise DescriptorValueError(f"an Nx3 array of int64 or uint64 is needed, got {descs.dtype}")
    if not descs.flags.c_contiguous:
        raise DescriptorValueError("a C-contiguous Nx3 array is needed (np.ascontiguousarray)")
    return np.asarray(descs)


def _desclist(rows: Any, mem: Any) -> DescList:
    try:
        return DescList(rows, mem)
    except InvalidDescriptor as exc:
        raise translate(exc) from exc


class _DList:
    """What the three NIXL list types share: a DescList plus one extra value per row (or none)."""

    __slots__ = ("_descs", "_extra")
    _width = 3

    def __init__(self, type: Any, descs: Any = 0) -> None:
        mem = mem_of(type)
        self._extra: tuple = ()
        if isinstance(descs, (int, np.integer)) and not isinstance(descs, bool):
            rows: Any = np.zeros((int(descs), 3), dtype=np.int64)  # NIXL's init_size: that many zero descriptors
        elif isinstance(descs, np.ndarray):
            rows = _array_rows(descs)
        elif isinstance(descs, list):
            rows = tuple_rows(descs, self._width)
            self._extra = self._extras(descs)
        else:
            # (``type`` is the memory-type argument here, not the builtin)
            what = f"{self.__class__.__name__} takes a list of tuples, an Nx3 array or a count"
            raise DescriptorTypeError(f"{what}, not a {descs.__class__.__name__}")
        self._descs = _desclist(rows, mem)
        if len(self._extra) != len(self._descs):
            self._extra = self._default_extra(len(self._descs))

    def _extras(self, descs: list) -> tuple:
        return ()

    def _default_extra(self, n: int) -> tuple:
        return ()

    def _extra_of(self, desc: tuple) -> Any:
        return None

    @classmethod
    def _wrap(cls, descs: DescList, extra: Sequence | None = None) -> Any:
        out = cls.__new__(cls)
        out._descs = descs
        out._extra = tuple(extra) if extra is not None else out._default_extra(len(descs))
        return out

    @property
    def descs(self) -> DescList:
        """The datamover DescList behind this list."""
        return self._descs

    def getType(self) -> nixl_mem_t:
        return seg_of(self._descs.mem_type)

    def descCount(self) -> int:
        return len(self._descs)

    def isEmpty(self) -> bool:
        return len(self._descs) == 0

    def __len__(self) -> int:
        return len(self._descs)

    def __bool__(self) -> bool:
        # NIXL's lists are always truthy: `if not descs:` tests for None, never for emptiness
        return True

    def _check_index(self, i: int) -> int:
        n = len(self._descs)
        if not -n <= i < n:
            raise IndexError(f"descriptor index {i} is out of range for {n} descriptors")
        return i % n

    def _set_rows(self, rows: np.ndarray) -> None:
        self._descs = _desclist(rows, self._descs.mem_type)

    def __getitem__(self, i: int) -> tuple:
        k = self._check_index(i)
        row = self._descs[k]
        return row if self._width == 3 else (*row, self._extra[k])

    def __iter__(self) -> Iterator[tuple]:
        return (self[i] for i in range(len(self)))

    def __setitem__(self, i: int, desc: tuple) -> None:
        k = self._check_index(i)
        rows = np.array(self._descs.rows)
        rows[k] = tuple_rows([tuple(desc)], self._width)[0]
        self._set_rows(rows)
        if self._width != 3:
            self._extra = (*self._extra[:k], self._extra_of(desc), *self._extra[k + 1 :])

    def addDesc(self, desc: tuple) -> None:
        self._set_rows(np.concatenate([self._descs.rows, tuple_rows([tuple(desc)], self._width)]))
        if self._width != 3:
            self._extra = (*self._extra, self._extra_of(desc))

    append = addDesc

    def remDesc(self, i: int) -> None:
        k = self._check_index(i)
        self._set_rows(np.delete(self._descs.rows, k, axis=0))
        self._extra = self._extra[:k] + self._extra[k + 1 :]

    def clear(self) -> None:
        self._set_rows(np.zeros((0, 3), dtype=np.int64))
        self._extra = ()

    def index(self, desc: tuple) -> int:
        """Position of ``desc`` in the list; nixlNotFoundError when absent."""
        row = tuple_rows([tuple(desc)], self._width)[0]
        for k in np.flatnonzero((self._descs.rows == row).all(axis=1)).tolist():
            if self._width == 3 or self._extra[k] == self._extra_of(desc):
                return k
        raise nixlNotFoundError(f"descriptor {tuple(desc)} is not in the list")

    def __eq__(self, other: object) -> bool:
        # as NIXL 1.5.1's lists: the type and every field, metaInfo (or agent name) included
        if type(other) is not type(self):
            return NotImplemented
        return self._descs == other._descs and self._extra == other._extra  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (type(self), (int(self.getType()), [self[i] for i in range(len(self))]))

    def print(self) -> None:
        """Print the list (NIXL's debugging aid)."""
        print(repr(self))

    def __repr__(self) -> str:
        rows = [self[i] for i in range(min(len(self), 8))]
        return f"{type(self).__name__}({self._descs.mem_type.value}, {rows}{' ...' if len(self) > 8 else ''})"


class nixlXferDList(_DList):
    """A transfer descriptor list: (addr, len, devId) rows of one memory type."""

    __slots__ = ()


class nixlRegDList(_DList):
    """A registration descriptor list: (addr, len, devId, metaInfo) rows of one memory type."""

    __slots__ = ()
    _width = 4

    def _extras(self, descs: list) -> tuple:
        return tuple(as_bytes(d[3]) for d in descs)

    def _default_extra(self, n: int) -> tuple:
        return (b"",) * n

    def _extra_of(self, desc: tuple) -> Any:
        return as_bytes(desc[3])

    @property
    def meta(self) -> tuple[bytes, ...]:
        """The metaInfo of every descriptor."""
        return self._extra

    def trim(self) -> nixlXferDList:
        """The same descriptors without metaInfo, as a transfer list."""
        return nixlXferDList._wrap(self._descs)


class nixlRemoteDList(_DList):
    """Descriptors of other agents' memory: (addr, len, devId, agent name) rows of one memory type."""

    __slots__ = ()
    _width = 4

    def _extras(self, descs: list) -> tuple:
        return tuple(as_name(d[3]) for d in descs)

    def _default_extra(self, n: int) -> tuple:
        return ("",) * n

    def _extra_of(self, desc: tuple) -> Any:
        return as_name(desc[3])

    @property
    def agents(self) -> tuple[str, ...]:
        """The agent each descriptor belongs to."""
        return self._extra
