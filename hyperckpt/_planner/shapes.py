"""The message for a destination whose shape differs from the checkpoint's tensor.

A torch sharded directory records no global shape: a tensor is as large as its pieces
reach.  When the file holding its highest rows is missing, the tensor looks smaller and no
rule about the files can notice; only the destination's shape can.  No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperckpt.errors import CheckpointError

__all__ = ["shape_mismatch"]


def shape_mismatch(
    fqn: str,
    stored: Sequence[int],
    wanted: Sequence[int],
    *,
    file: str | None = None,
    origin: str = "",
) -> CheckpointError:
    """The error for tensor ``fqn`` stored as ``stored`` but wanted as ``wanted``.

    Args:
        fqn: The tensor's name.
        stored: Its shape in the checkpoint (in the destination's units).
        wanted: The destination's (global) shape.
        file: A file holding a piece of it, as messages name it, if known.
        origin: Where the stored tensor came from when not straight from the checkpoint,
            as a clause that follows "in the state dict" (a mapping's sources).
    """
    where = f"{file}: " if file else ""
    larger = [d for d, (have, want) in enumerate(zip(stored, wanted, strict=False)) if want > have]
    if len(stored) == len(wanted) and larger:
        dims = ", ".join(str(d) for d in larger)
        cause = (
            f"the destination is larger along dimension {dims}: a shard file is probably "
            f"missing (the one holding the tensor's highest indices along dimension {dims}), "
            f"so its pieces reach only {list(stored)}; check that every file the job wrote "
            f"is there, or that the state dict belongs to this checkpoint's model"
        )
    else:
        cause = "the checkpoint belongs to another model configuration"
    return CheckpointError(
        f"{where}tensor {fqn!r} has shape {list(stored)} in the checkpoint but "
        f"{list(wanted)} in the state dict{origin}; {cause}",
        path=file,
        tensor=fqn,
        rule="load.shape_mismatch",
    )
