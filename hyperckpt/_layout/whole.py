"""A Hugging Face checkpoint's tensors as columns over its files' tables, viewed as layouts.

Every tensor of a Hugging Face checkpoint is whole in one file, so its layout is one row of
that file's :class:`~hyperckpt._format.table.EntryTable`.  :class:`WholeTensors` keeps, per
tensor in name order, which file and which row; ``CheckpointLayout.tensors[name]`` builds
the public :class:`~hyperckpt._layout.model.TensorLayout` (one whole piece) when asked.
No torch import here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from hyperckpt._format.table import CODES, EntryTable
from hyperckpt._layout.model import Piece, TensorLayout

__all__ = ["WholeTensors"]

_ROW_BITS: Final = 32


class WholeTensors(Mapping[str, TensorLayout]):
    """Whole tensors of several files, by name in name order; values built on lookup.

    Attributes:
        files: Each file's name and table, in the layout's file order.
        names: Every tensor's name, sorted.
        places: For each name, ``file number << 32 | row`` in that file's table (int64).
    """

    __slots__ = ("_where", "files", "names", "places")

    def __init__(
        self,
        files: Sequence[tuple[str, EntryTable]],
        names: tuple[str, ...],
        places: npt.NDArray[np.int64],
        where: dict[str, int] | None = None,
    ) -> None:
        self.files = tuple(files)
        self.names = names
        self.places = places
        self._where = where

    @classmethod
    def of(cls, files: Sequence[tuple[str, EntryTable]], owner: Mapping[str, str]) -> WholeTensors:
        """The tensors ``owner`` places (name -> file), each a row of its file's table."""
        number = {name: index for index, (name, _) in enumerate(files)}
        where: dict[str, int] = {}
        for file, table in files:
            base = number[file] << _ROW_BITS
            for row, tensor in enumerate(table.names):
                if owner.get(tensor) == file:
                    where[tensor] = base | row
        names = tuple(sorted(where))
        places = np.array([where[name] for name in names], np.int64)
        return cls(files, names, places, where)

    @classmethod
    def at(
        cls, files: Sequence[tuple[str, EntryTable]], places: npt.NDArray[np.int64]
    ) -> WholeTensors:
        """The tensors at ``places`` (``file number << 32 | row``, in name order)."""
        mask = (1 << _ROW_BITS) - 1
        tables = [table.names for _, table in files]
        names = tuple(tables[place >> _ROW_BITS][place & mask] for place in places.tolist())
        return cls(files, names, places)

    def place(self, name: str) -> tuple[str, EntryTable, int]:
        """The file's name, its table and the row where ``name`` lives.

        Raises:
            KeyError: No such tensor.
        """
        where = self._where
        if where is None:
            where = self._where = dict(zip(self.names, self.places.tolist(), strict=True))
        place = where[name]
        file, table = self.files[place >> _ROW_BITS]
        return file, table, place & ((1 << _ROW_BITS) - 1)

    def __getitem__(self, name: str) -> TensorLayout:
        file, table, row = self.place(name)
        shape = table.shape(row)
        piece = Piece(file, (0,) * len(shape), shape, int(table.starts[row]), int(table.stops[row]))
        return TensorLayout(name, CODES[table.codes[row]], shape, (piece,))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.place(name)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"WholeTensors({len(self.names)} tensors in {len(self.files)} files)"

    def rows(self) -> Iterator[tuple[str, str, str, tuple[int, ...], int, int]]:
        """Every tensor as ``(name, file, dtype, shape, start, stop)``, in name order, from
        the columns (no value object built)."""
        columns = [
            (file, table.codes, table.shapes(), table.starts.tolist(), table.stops.tolist())
            for file, table in self.files
        ]
        mask = (1 << _ROW_BITS) - 1
        for name, place in zip(self.names, self.places.tolist(), strict=True):
            file, codes, shapes, starts, stops = columns[place >> _ROW_BITS]
            row = place & mask
            yield name, file, CODES[codes[row]], shapes[row], starts[row], stops[row]

    @property
    def nbytes(self) -> int:
        """Bytes of data of every tensor."""
        mask = (1 << _ROW_BITS) - 1
        files = (self.places >> _ROW_BITS).astype(np.int64)
        rows = self.places & mask
        total = 0
        for number, (_, table) in enumerate(self.files):
            picked = rows[files == number]
            total += int((table.stops[picked] - table.starts[picked]).sum())
        return total
