"""One object in a store open for reading: its stamp, its ETag pinned, and exact ranged GETs.

Every response is checked before a byte is used: the status, ``Content-Range`` (the range
asked for, of an object of the stamped size), the ETag and the body's length; a body that
ends early (a dropped connection) is fetched again.  No torch.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from hyperckpt._storage.s3_requests import Retry, attempt, stream
from hyperckpt._storage.stamp import FileStamp, stamp_changes
from hyperckpt.errors import CheckpointChangedError, CheckpointError

if TYPE_CHECKING:
    from hyperckpt._storage.remote import S3Storage

__all__ = ["S3File"]


class S3File:
    """One object open for reading: its stamp (ETag pinned) and exact ranged reads.

    Reads are independent ranged GETs, so one file serves many threads.

    Attributes:
        name: How messages name it (relative to the checkpoint's prefix).
        stamp: Its identity when it was opened; every read pins its ETag.
    """

    __slots__ = ("_again", "_head", "_key", "_storage", "name", "stamp")

    def __init__(
        self,
        storage: S3Storage,
        name: str,
        stamp: FileStamp,
        *,
        again: str | None = None,
        head: bytes = b"",
    ) -> None:
        self._storage = storage
        self._key = storage.resolve(name)
        self._again = again
        self._head = head  # the object's first bytes, fetched with its stamp
        self.name = name
        self.stamp = stamp

    @property
    def size(self) -> int:
        """Bytes in the object when its stamp was taken."""
        return self.stamp.size

    def fileno(self) -> int:
        """Refused: an object has no descriptor (the read engine takes its remote route)."""
        raise ValueError(f"{self._storage.url(self.name)}: an object in a store has no descriptor")

    def read_exact(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset`` (one ranged GET, retried; none for the
        bytes fetched when the object was opened)."""
        held = self._head[offset : offset + length]
        if len(held) == length:
            return held
        buffer = bytearray(length - len(held))
        self.readinto(offset + len(held), memoryview(buffer))
        return held + bytes(buffer)

    def readinto(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset`` with one ranged GET (the body streamed into it).

        Raises:
            CheckpointChangedError: Another version is there (``412``), the object is gone,
                or the range is past its end.
            CheckpointError: The response was the wrong range or length, or the tries ran
                out; the message names the object, the range and the last error.
        """
        self.readinto_many(offset, [buffer])

    def readinto_many(self, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order with the object's consecutive bytes from ``offset``, one
        ranged GET for all of them (a gap between two wanted ranges is a buffer dropped)."""
        length = sum(len(b) for b in buffers)
        if length == 0:
            return
        if offset + length <= len(self._head):  # fetched when the object was opened
            for buffer in buffers:
                buffer[:] = self._head[offset : offset + len(buffer)]
                offset += len(buffer)
            return
        end = offset + length - 1
        storage = self._storage
        where = storage.url(self.name)
        what = f"GET bytes {offset}-{end}"
        if offset + length > self.size:
            raise CheckpointChangedError(
                f"{where}: bytes {offset}-{end} asked of an object of {self.size} bytes; "
                f"{self._again or 'start again'}",
                path=self.name,
            )
        args: dict[str, str] = {
            "Bucket": storage.bucket,
            "Key": self._key,
            "Range": f"bytes={offset}-{end}",
        }
        if self.stamp.etag:
            args["IfMatch"] = self.stamp.etag
        if self.stamp.version:
            args["VersionId"] = self.stamp.version

        def one_try() -> dict[str, Any]:
            response = storage._client.get_object(**args)
            body = response["Body"]
            try:
                self._check_response(response, offset, end, length, where, what)
                got = stream(body, buffers)
            finally:
                body.close()
            storage.counts.add(gets=1, bytes=got)
            if got < length:
                raise Retry(f"a short body ({got} of {length} bytes)")
            return {}

        attempt(
            storage.settings, storage.counts, one_try, what=what, where=where, again=self._again
        )

    def _check_response(
        self,
        response: dict[str, Any],
        offset: int,
        end: int,
        length: int,
        where: str,
        what: str,
    ) -> None:
        expected = f"bytes {offset}-{end}/{self.size}"
        got_range = response.get("ContentRange")
        got_length = response.get("ContentLength")
        etag = response.get("ETag")
        if self.stamp.etag and etag is not None and etag != self.stamp.etag:
            raise CheckpointChangedError(
                f"{where}: {what} answered with ETag {etag}, not {self.stamp.etag} whose header "
                f"was read; {self._again or 'start again'}",
                path=self.name,
            )
        if got_range != expected or got_length != length:
            raise CheckpointError(
                f"{where}: {what} answered Content-Range {got_range!r} and Content-Length "
                f"{got_length!r}, expected {expected!r} and {length}; the store (or a proxy in "
                f"front of it) answered another range: its bytes are not used",
                path=self.name,
            )

    def check_unchanged(self, expected: FileStamp, *, when: str, again: str) -> None:
        """Refuse an object whose pinned stamp differs from ``expected`` (each read already
        refused another version with ``If-Match``; no request is made)."""
        changes = [
            change
            for change in stamp_changes(expected, self.stamp, device=False)
            if change.startswith(("size", "etag", "version"))
        ]
        if changes:
            raise CheckpointChangedError(
                f"{self._storage.url(self.name)}: changed {when} ({', '.join(changes)}); {again}",
                path=self.name,
            )

    def close(self) -> None:
        """Nothing to release: each read is its own request."""

    def __enter__(self) -> S3File:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
