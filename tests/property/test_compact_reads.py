"""A compact plan's rows read exactly the bytes its ``ReadItem``s read, into poisoned destinations.

One process, ``dcp.load`` without a process group (DCP then hands the planner's own plan
to ``read_data``): the same drawn checkpoint loaded with ``hyperckpt.SafetensorsLoadPlanner`` planning
compact rows and planning a list, each into destinations filled with ``0xFF`` bytes; both
must hold the stored values, converted where the destination's dtype differs.  Destinations
of the stored dtype go through the rows' in-place path, the others (another dtype, a
non-contiguous view, a parameter) through the items they are made into.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import sample_tensor, write_hf_checkpoint
from hypothesis import given
from hypothesis import strategies as st

from hyperckpt import HuggingFaceStorageReader, SafetensorsLoadPlanner
from hyperckpt._planner.compact import CompactItems
from hyperckpt._read import engine as engine_module

_DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.float16, torch.uint8]
_KINDS = ["same", "same", "same", "wider", "transposed", "parameter"]
_SHAPE = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> torch.Tensor:
    """A destination of ``shape`` whose every byte is ``0xFF``."""
    transposed = kind == "transposed" and len(shape) == 2
    base = torch.empty(
        shape[::-1] if transposed else shape, dtype=torch.float64 if kind == "wider" else dtype
    )
    base.reshape(-1).view(torch.uint8).fill_(0xFF)
    if transposed:
        return base.t()  # not contiguous
    if kind == "parameter":
        return torch.nn.Parameter(base, requires_grad=False)
    return base


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when no process group is up
@given(
    st.lists(
        st.tuples(_SHAPE, st.sampled_from(_DTYPES), st.sampled_from(_KINDS)),
        min_size=1,
        max_size=10,
    ),
    st.integers(1, 3),
)
def test_compact_rows_read_exactly_the_bytes_the_read_items_read(
    drawn: list[tuple[tuple[int, ...], torch.dtype, str]], files: int
) -> None:
    stored = {
        f"layer.{n}.weight": sample_tensor(shape, dtype, seed=n)
        for n, (shape, dtype, _) in enumerate(drawn)
    }
    kinds = {f"layer.{n}.weight": kind for n, (_, _, kind) in enumerate(drawn)}
    rows_seen: list[int] = []
    routed = engine_module.routed

    def spy(items, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows_seen.append(items.rows() if isinstance(items, CompactItems) else -1)
        return routed(items, *args, **kwargs)

    with tempfile.TemporaryDirectory() as tmp:
        root = write_hf_checkpoint(Path(tmp) / "ckpt", stored, files=min(files, len(stored)))
        loaded = []
        for compact in (True, False):
            state = {
                name: _poisoned(tuple(t.shape), t.dtype, kinds[name]) for name, t in stored.items()
            }
            planner = SafetensorsLoadPlanner()
            planner.compact_items = compact
            engine_module.routed = spy  # type: ignore[assignment]
            try:
                dcp.load(
                    state,
                    storage_reader=HuggingFaceStorageReader(root, thread_count=2),
                    planner=planner,
                    no_dist=True,
                )
            finally:
                engine_module.routed = routed
            loaded.append(state)
    # An empty tensor has no item (torch's overlap test), every other one is a row.
    assert rows_seen[0] == sum(t.numel() > 0 for t in stored.values()), "rows reached the engine"
    assert rows_seen[1] == -1, "the list plan was read as items"
    for name, truth in stored.items():
        expected = _bits(truth.to(loaded[0][name].dtype))
        assert _bits(loaded[0][name]) == expected, (name, kinds[name])
        assert _bits(loaded[1][name]) == expected, (name, kinds[name])
