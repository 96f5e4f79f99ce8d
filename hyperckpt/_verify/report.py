"""What a verification found: per-file digests, per-tensor value counts, and the report's verdict."""

from __future__ import annotations

from dataclasses import dataclass

from hyperckpt._format.preview import preview
from hyperckpt._layout.model import Kind
from hyperckpt._verify.checksums import Expected
from hyperckpt.errors import CheckpointError

__all__ = ["FileCheck", "TensorCheck", "VerifyReport"]


@dataclass(frozen=True, slots=True)
class FileCheck:
    """One file's digest and what it was compared with.

    Attributes:
        name: The file, relative to the checkpoint directory.
        size: Its size in bytes (0 when missing).
        sha256: Lowercase hex sha256 of its content; ``None`` when missing.
        expected: Every expectation found for it (checksum file, cache blob name).
        mismatched: Those it does not meet.
        missing: A checksum file lists it but it does not exist.
    """

    name: str
    size: int
    sha256: str | None
    expected: tuple[Expected, ...]
    mismatched: tuple[Expected, ...]
    missing: bool = False

    @property
    def ok(self) -> bool:
        """Present and meeting every expectation (vacuously true without any)."""
        return not self.missing and not self.mismatched


@dataclass(frozen=True, slots=True)
class TensorCheck:
    """What one tensor's stored values hold (all its pieces together).

    Attributes:
        name: The tensor's name.
        dtype: Its safetensors dtype code.
        files: The files holding its pieces, relative to the checkpoint directory.
        elements: Elements in the whole tensor (header units).
        floating: Whether the dtype is a floating-point format (NaN/Inf counted).
        nan: NaN values (components for ``C64``).
        posinf: ``+Inf`` values.
        neginf: ``-Inf`` values.
        all_zero: Every value is zero; ``False`` when empty.
    """

    name: str
    dtype: str
    files: tuple[str, ...]
    elements: int
    floating: bool
    nan: int
    posinf: int
    neginf: int
    all_zero: bool

    @property
    def nonfinite(self) -> int:
        """NaN and infinities together."""
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`hyperckpt.verify` found.

    Attributes:
        path: The checkpoint directory.
        kind: ``"huggingface"`` or ``"torch-sharded"``.
        files: Each file read (the checkpoint's, the index and any other file a checksum
            file lists), and each listed file that is missing, by name.
        tensors: Each tensor, by name.
        bytes_read: Bytes read, all files together.
        seconds: Wall time of the data pass, in seconds.
        checksum_file: The checksum file compared with, if any.
    """

    path: str
    kind: Kind
    files: tuple[FileCheck, ...]
    tensors: tuple[TensorCheck, ...]
    bytes_read: int
    seconds: float
    checksum_file: str | None = None

    @property
    def mismatches(self) -> tuple[FileCheck, ...]:
        """Files missing or whose digest differs from an expectation."""
        return tuple(f for f in self.files if not f.ok)

    @property
    def unchecked(self) -> tuple[FileCheck, ...]:
        """Files read without any digest to compare with."""
        return tuple(f for f in self.files if not f.expected and not f.missing)

    @property
    def nonfinite(self) -> tuple[TensorCheck, ...]:
        """Tensors holding NaN or infinities."""
        return tuple(t for t in self.tensors if t.nonfinite)

    @property
    def all_zero(self) -> tuple[TensorCheck, ...]:
        """Non-empty tensors whose values are all zero (reported, never an error)."""
        return tuple(t for t in self.tensors if t.all_zero)

    def ok(self, *, allow_nonfinite: bool = False) -> bool:
        """No checksum problem and, unless allowed, no NaN or infinity."""
        return not self.mismatches and (allow_nonfinite or not self.nonfinite)

    def check(self, *, allow_nonfinite: bool = False) -> None:
        """Raise when :meth:`ok` is false.

        Raises:
            CheckpointError: Listing every file that is missing or differs from its
                expected digest and, unless ``allow_nonfinite``, every tensor with NaN or
                infinities; ``path`` and ``tensor`` name the first.
        """
        lines = [_mismatch_line(f) for f in self.mismatches]
        if not allow_nonfinite:
            lines += [_nonfinite_line(t) for t in self.nonfinite]
        if not lines:
            return
        first_file = self.mismatches[0].name if self.mismatches else None
        first_tensor = self.nonfinite[0] if self.nonfinite and not allow_nonfinite else None
        raise CheckpointError(
            f"{self.path}: the data does not check out: "
            + preview(lines, 20, separator="; ", quote=False)
            + "; "
            + _advice(bool(self.mismatches), first_tensor is not None),
            path=first_file if first_file else (first_tensor.files[0] if first_tensor else None),
            tensor=None if first_tensor is None else first_tensor.name,
        )


def _mismatch_line(check: FileCheck) -> str:
    if check.missing:
        sources = ", ".join(e.source for e in check.expected)
        return f"{check.name}: missing (listed in {sources})"
    parts = [
        f"{check.name}: {e.algorithm} {_got(check, e)} but {e.source} says {e.digest}"
        for e in check.mismatched
    ]
    return "; ".join(parts)


def _got(check: FileCheck, expected: Expected) -> str:
    return check.sha256 or "?" if expected.algorithm == "sha256" else "differs"


def _nonfinite_line(tensor: TensorCheck) -> str:
    return (
        f"{tensor.files[0]}: tensor {tensor.name!r} ({tensor.dtype}) has {tensor.nan} NaN, "
        f"{tensor.posinf} +Inf, {tensor.neginf} -Inf of {tensor.elements} values"
    )


def _advice(mismatch: bool, nonfinite: bool) -> str:
    parts = []
    if mismatch:
        parts.append(
            "a file was corrupted or changed after its checksum was taken: download "
            "or copy it again"
        )
    if nonfinite:
        parts.append(
            "the saved weights hold NaN/Inf (a run that diverged, or a bad "
            "conversion): use an earlier checkpoint, or allow_nonfinite=True to only "
            "report them"
        )
    return "; ".join(parts)
