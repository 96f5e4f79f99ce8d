"""One file's tensors held as columns: names, dtype codes, shapes and byte ranges as arrays.

A DeepSeek-V3 checkpoint has 92k tensors; one frozen object per tensor (and the pickled
copy of each that the headers-once broadcast sends) was a third of ``describe``.  An
:class:`EntryTable` keeps a file's validated entries as a handful of arrays and builds the
public :class:`~hyperckpt._format.header.TensorEntry` of a tensor only when it is asked
for, so ``FileHeader.tensors`` stays a ``Mapping[str, TensorEntry]``.

:func:`entry_table` is the fast path of validation: one pass over the parsed entries with
every per-entry rule of :func:`~hyperckpt._format.entries.check_entry`, then the tiling of
the data buffer (sort, contiguity, file size) on the arrays at once.  It answers ``None``
whenever any rule might fail; the caller then runs the rules one by one, in the reference's
order, to name the one broken.  No torch import here.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from hyperckpt._format.dtypes import DTYPES, LOADABLE_BITS, MAX_ELEMENT_BITS
from hyperckpt._format.entries import MAX_TORCH_SIZE
from hyperckpt._format.strict_json import is_unicode

__all__ = [
    "CODES",
    "CODE_OF",
    "ByteSpan",
    "Entry",
    "EntryTable",
    "Packed",
    "TensorEntry",
    "entry_table",
    "table_of_entries",
]

#: The dtype codes, in the format's order; a table stores a code as its position here.
CODES: Final[tuple[str, ...]] = tuple(DTYPES)
#: Position of each code in :data:`CODES`.
CODE_OF: Final[Mapping[str, int]] = {code: number for number, code in enumerate(CODES)}
_KEYS: Final = frozenset({"dtype", "shape", "data_offsets"})
_NAME_SEPARATOR: Final = "\x00"  # never in a valid tensor name

#: A checked entry: ``(name, dtype code, shape, begin, end)``, offsets relative to the data.
Entry = tuple[str, str, tuple[int, ...], int, int]
Int64s = npt.NDArray[np.int64]
Int32s = npt.NDArray[np.int32]
#: A table packed to travel: compressed names, codes, ranks, sizes and starts, and the end.
Packed = tuple[bytes, bytes, bytes, bytes, bytes, int]


class ByteSpan:
    """What a value with a half-open byte range ``[start, stop)`` knows of it: its length.

    Subclasses are frozen dataclasses with ``start`` and ``stop`` fields.
    """

    __slots__ = ()
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Length of the data in bytes."""
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class TensorEntry(ByteSpan):
    """One tensor in a safetensors file (a row of an :class:`EntryTable`, built on demand).

    Attributes:
        name: The tensor's key in the header.
        dtype: The safetensors dtype code, e.g. ``"BF16"``.
        shape: Size of each dimension, in elements; ``()`` for a 0-d tensor.
        start: First byte of the data, absolute in the file (header included).
        stop: One past the last byte, absolute in the file (half-open ``[start, stop)``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


class EntryTable(Mapping[str, TensorEntry]):
    """A file's validated tensors as columns, ordered by position in the file.

    Read-only.  As a mapping it yields a fresh ``TensorEntry`` per lookup (equal to any
    other for the same tensor); the columns are for code that walks every tensor.

    Attributes:
        names: Each tensor's name, in file order.
        codes: Each tensor's dtype as its position in :data:`CODES` (one byte each).
        ndims: Each tensor's number of dimensions (int32).
        dims: Every tensor's sizes, one after the other, in elements (int64).
        starts: First byte of each tensor's data, absolute in the file (int64).
        stops: One past each tensor's last byte, absolute in the file (int64; half-open).
    """

    __slots__ = ("_first_dim", "_rows", "codes", "dims", "names", "ndims", "starts", "stops")

    def __init__(
        self,
        names: tuple[str, ...],
        codes: bytes,
        ndims: Int32s,
        dims: Int64s,
        starts: Int64s,
        stops: Int64s,
    ) -> None:
        self.names = names
        self.codes = codes
        self.ndims = ndims
        self.dims = dims
        self.starts = starts
        self.stops = stops
        self._rows: dict[str, int] | None = None
        self._first_dim: list[int] | None = None

    def row(self, name: str) -> int:
        """The tensor's position in the file.

        Raises:
            KeyError: The file holds no such tensor.
        """
        rows = self._rows
        if rows is None:
            rows = self._rows = {name: row for row, name in enumerate(self.names)}
        return rows[name]

    def shape(self, row: int) -> tuple[int, ...]:
        """The shape of the tensor at ``row``, in elements."""
        first = self._first_dim
        if first is None:
            first = self._first_dim = [0, *np.cumsum(self.ndims, dtype=np.int64).tolist()]
        return tuple(self.dims[first[row] : first[row + 1]].tolist())

    def shapes(self) -> list[tuple[int, ...]]:
        """Every tensor's shape, in file order (one pass over the columns)."""
        dims = self.dims.tolist()
        shapes = []
        at = 0
        for ndim in self.ndims.tolist():
            shapes.append(tuple(dims[at : at + ndim]))
            at += ndim
        return shapes

    def __getitem__(self, name: str) -> TensorEntry:
        row = self.row(name)
        return TensorEntry(
            name,
            CODES[self.codes[row]],
            self.shape(row),
            int(self.starts[row]),
            int(self.stops[row]),
        )

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.row(name)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"EntryTable({len(self.names)} tensors)"

    def __reduce__(self) -> tuple[object, ...]:
        return (_unpack, (self.pack(),))

    def pack(self) -> Packed:
        """The columns as a few compressed byte strings (what the headers broadcast sends).

        Names share long prefixes and sizes repeat, so each column is deflated; the stops
        are not sent: in file order each tensor ends where the next starts.
        """
        end = int(self.stops[-1]) if len(self.names) else 0
        return (
            zlib.compress(_NAME_SEPARATOR.join(self.names).encode("utf-8"), 1),
            zlib.compress(self.codes, 1),
            zlib.compress(self.ndims.astype(np.int32).tobytes(), 1),
            zlib.compress(self.dims.astype(np.int64).tobytes(), 1),
            zlib.compress(self.starts.astype(np.int64).tobytes(), 1),
            end,
        )

    @classmethod
    def unpack(cls, packed: Packed) -> EntryTable:
        """The table :meth:`pack` packed."""
        joined, codes, ndims, dims, starts, end = packed
        kept = zlib.decompress(codes)
        first = np.frombuffer(zlib.decompress(starts), np.int64)
        return cls(
            tuple(zlib.decompress(joined).decode("utf-8").split(_NAME_SEPARATOR)) if kept else (),
            kept,
            np.frombuffer(zlib.decompress(ndims), np.int32),
            np.frombuffer(zlib.decompress(dims), np.int64),
            first,
            np.append(first[1:], np.int64(end)) if len(first) else first.copy(),
        )


def _unpack(packed: Packed) -> EntryTable:
    return EntryTable.unpack(packed)


def entry_table(
    document: Mapping[str, object], data_start: int, file_size: int
) -> EntryTable | None:
    """The table of a header's entries when every rule holds, else ``None``.

    The per-entry rules of :func:`~hyperckpt._format.entries.valid_entry` run in one pass,
    written out in the loop rather than called (describe's hot path: one Python call less for
    each of up to ~100k entries); a change to those rules changes both, and the format and
    hostile tests hold them equal;
    the data buffer's tiling (entries contiguous from 0 in offset order, the last ending at
    the file's end) runs on the arrays.  ``None`` says only that some rule may fail: the
    caller checks the entries one by one to name it.

    Args:
        document: The header's entries (``__metadata__`` removed), in document order.
        data_start: Absolute offset of the data buffer.
        file_size: The file's size in bytes.
    """
    room = file_size - data_start
    names: list[str] = []
    codes = bytearray()
    ndims: list[int] = []
    dims: list[int] = []
    begins: list[int] = []
    ends: list[int] = []
    bits_of = LOADABLE_BITS
    code_of = CODE_OF
    for key, value in document.items():
        if type(value) is not dict or value.keys() != _KEYS:
            return None
        dtype = value["dtype"]
        shape = value["shape"]
        offsets = value["data_offsets"]
        if type(dtype) is not str or type(shape) is not list or type(offsets) is not list:
            return None
        bits = bits_of.get(dtype)
        if bits is None or len(offsets) != 2:
            return None
        for size in shape:
            if type(size) is not int or not 0 <= size < MAX_TORCH_SIZE:
                return None
            bits *= size
        begin, end = offsets
        if (
            type(begin) is not int
            or type(end) is not int
            or not 0 <= begin <= end <= room
            or bits >= MAX_ELEMENT_BITS
            or bits % 8
            or end - begin != bits // 8
            or (dtype == "F4" and (not shape or shape[-1] % 2))
            or not key
            or "\x00" in key
            or not (key.isascii() or is_unicode(key))
        ):
            return None
        names.append(key)
        codes.append(code_of[dtype])
        ndims.append(len(shape))
        dims += shape
        begins.append(begin)
        ends.append(end)
    return _tiled(names, codes, ndims, dims, begins, ends, data_start, file_size)


def table_of_entries(entries: Sequence[Entry], data_start: int) -> EntryTable:
    """The table of entries already checked one by one and ordered by position."""
    dims: list[int] = []
    for entry in entries:
        dims += entry[2]
    return EntryTable(
        tuple(entry[0] for entry in entries),
        bytes(CODE_OF[entry[1]] for entry in entries),
        np.array([len(entry[2]) for entry in entries], np.int32),
        np.array(dims, np.int64),
        np.array([entry[3] for entry in entries], np.int64) + data_start,
        np.array([entry[4] for entry in entries], np.int64) + data_start,
    )


def _tiled(
    names: list[str],
    codes: bytearray,
    ndims: list[int],
    dims: list[int],
    begins: list[int],
    ends: list[int],
    data_start: int,
    file_size: int,
) -> EntryTable | None:
    """The table, ordered by offsets, if the entries tile ``[0, file_size - data_start)``."""
    begin = np.array(begins, np.int64)
    end = np.array(ends, np.int64)
    order = np.lexsort((end, begin))  # stable: ties keep document order, as sorted() does
    begin = begin[order]
    end = end[order]
    if len(order):
        if begin[0] != 0 or not np.array_equal(begin[1:], end[:-1]):
            return None
        if data_start + int(end[-1]) != file_size:
            return None
    elif data_start != file_size:
        return None
    ranks = np.array(ndims, np.int32)
    flat = np.array(dims, np.int64)
    if np.array_equal(order, np.arange(len(order))):
        return EntryTable(
            tuple(names), bytes(codes), ranks, flat, begin + data_start, end + data_start
        )
    # Gather each row's dimensions in the new order: row r's run starts at first[r].
    first = np.concatenate(([0], np.cumsum(ranks, dtype=np.int64)))[:-1]
    new_ranks = ranks[order]
    new_first = np.concatenate(([0], np.cumsum(new_ranks, dtype=np.int64)))[:-1]
    at = np.arange(len(flat), dtype=np.int64) + np.repeat(first[order] - new_first, new_ranks)
    rows = order.tolist()
    return EntryTable(
        tuple(names[row] for row in rows),
        bytes(codes[row] for row in rows),
        new_ranks,
        flat[at],
        begin + data_start,
        end + data_start,
    )
