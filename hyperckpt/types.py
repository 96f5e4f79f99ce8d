"""The values hyperckpt's calls return and take: layouts, headers, reports, progress.

``import hyperckpt`` imports this module; its names are ``hyperckpt.types.LoadReport`` and so
on.  The root holds the verbs, the readers, the writer, the planner, the options, the
errors and :class:`~hyperckpt.Mapping`.
"""

from __future__ import annotations

from hyperckpt._consolidate import ConsolidateReport
from hyperckpt._exchange.costs import CostModel
from hyperckpt._format.header import FileHeader, TensorEntry
from hyperckpt._layout.model import CheckpointLayout, Piece, TensorLayout
from hyperckpt._load.api import LoadReport
from hyperckpt._read.dtype_policy import Conversion
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._read.tracker import Progress
from hyperckpt._save import SaveReport
from hyperckpt._storage.stamp import FileStamp
from hyperckpt._verify import FileCheck, TensorCheck, VerifyReport

__all__ = [
    "CheckpointLayout",
    "ConsolidateReport",
    "Conversion",
    "CostModel",
    "FileCheck",
    "FileHeader",
    "FileStamp",
    "LoadReport",
    "LoadStats",
    "Piece",
    "Progress",
    "SaveReport",
    "StorageInfo",
    "TensorCheck",
    "TensorEntry",
    "TensorLayout",
    "VerifyReport",
]

# Each type says where users import it from (reprs, pickles, docs).
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
