"""Object storage behind the storage protocols: ``s3://bucket/prefix`` read by ranged GETs.

:class:`S3Storage` is a checkpoint "directory" in an S3 bucket (or an S3-compatible store):
names are keys under the prefix, an entry's stamp comes from a ``HEAD`` (size, ETag,
version, last modification), and an :class:`~hyperckpt._storage.s3_file.S3File` reads
exact byte ranges with one ranged ``GET`` each, the object's ETag pinned (``If-Match``): an
object replaced after its stamp was taken answers ``412`` and is refused as changed, so
bytes of two versions never mix.  Requests are made and retried by
:mod:`hyperckpt._storage.s3_requests`.  Writing is refused: a consolidation from a bucket
writes to a local directory.

The client is boto3 (the ``s3`` extra: ``pip install hyperckpt[s3]``), chosen by
measurement (``docs/design.md``, "Object storage"); endpoint, region and credentials come
the standard way (``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, the
credential chain).  No torch.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final, NoReturn

from hyperckpt._storage.protocol import Entry
from hyperckpt._storage.s3_file import S3File
from hyperckpt._storage.s3_requests import (
    RemoteSettings,
    RequestCounts,
    Retry,
    attempt,
    shared_client,
    status_of,
    stream,
)
from hyperckpt._storage.stamp import FileStamp
from hyperckpt.errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointNotFoundError,
    RuleId,
)

if TYPE_CHECKING:
    from hyperckpt._storage.protocol import NewFile

__all__ = [
    "SCHEMES",
    "RemoteSettings",
    "S3File",
    "S3Storage",
    "is_remote",
    "split_url",
]

#: URL schemes read from object storage.
SCHEMES: Final = ("s3://",)
#: Keys listed at most in one folder: more than any checkpoint holds.
MAX_LISTED: Final = 100_000
#: Bytes of the GET that opens a small whole object (an index): most are read in one.
WHOLE_FIRST_READ: Final = 256 * 2**10
#: Objects opened ahead at once.
_AHEAD_THREADS: Final = 32


def is_remote(path: object) -> bool:
    """Whether ``path`` is an object-storage URL (``s3://...``)."""
    return isinstance(path, str) and path.startswith(SCHEMES)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` as ``("bucket", "some/prefix")``.

    Raises:
        CheckpointError: No bucket is named.
    """
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise CheckpointError(
            f"{url}: no bucket named; an object-storage checkpoint is s3://<bucket>/<prefix>",
            path=url,
        )
    return bucket, prefix.strip("/")


class S3Storage:
    """The objects under ``s3://bucket/prefix``, as a read-only :class:`Storage`.

    Args:
        url: ``s3://bucket/prefix`` (a trailing slash or none).
        settings: Timeouts and retries; the defaults suit a cloud store.
        client: A boto3 S3 client to use (tests); by default one is made from the
            environment (``AWS_ENDPOINT_URL``, region, the credential chain).

    Attributes:
        counts: The requests made so far, all files and threads together.
    """

    def __init__(
        self,
        url: str,
        *,
        settings: RemoteSettings | None = None,
        client: Any = None,
    ) -> None:
        self.bucket, self.prefix = split_url(url)
        self._root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.settings = settings or RemoteSettings()
        self._client: Any = client if client is not None else shared_client(self.settings, url)
        self.counts = RequestCounts()
        self._ahead: dict[tuple[str, int], Future[S3File]] = {}
        # Opened by open_file already (fetched there or taken from ahead): never again ahead.
        self._taken: set[tuple[str, int]] = set()
        self._ahead_lock = threading.Lock()
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._ahead_closing = False

    @property
    def root(self) -> str:
        """``s3://bucket/prefix``."""
        return self._root

    def url(self, name: str) -> str:
        """The URL of ``name``, for messages."""
        return f"{self._root}/{name}"

    def resolve(self, name: str) -> str:
        """The key of ``name``, a path relative to the prefix.

        Raises:
            CheckpointError: ``name`` is absolute or climbs out with ``..``
                (``file.outside_checkpoint``).
        """
        normalized = posixpath.normpath(name)
        if posixpath.isabs(normalized) or normalized == ".." or normalized.startswith("../"):
            raise CheckpointError(
                f"{name}: leads outside the checkpoint {self._root}; only objects under its "
                f"prefix are read",
                path=name,
                rule="file.outside_checkpoint",
            )
        return f"{self.prefix}/{normalized}" if self.prefix else normalized

    def names(self) -> list[str]:
        """The names directly under the prefix (objects and folders), sorted.

        Raises:
            CheckpointError: The listing failed, or holds more than :data:`MAX_LISTED` names.
        """
        prefix = f"{self.prefix}/" if self.prefix else ""
        found: set[str] = set()
        token: str | None = None
        while True:
            args: dict[str, str] = {"Bucket": self.bucket, "Prefix": prefix, "Delimiter": "/"}
            if token:
                args["ContinuationToken"] = token
            page = attempt(
                self.settings,
                self.counts,
                lambda a=args: self._client.list_objects_v2(**a),  # type: ignore[misc]
                what=f"listing {self._root}/",
                where=self._root,
            )
            self.counts.add(lists=1)
            found.update(item["Key"][len(prefix) :] for item in page.get("Contents", []))
            found.update(
                item["Prefix"][len(prefix) :].rstrip("/") for item in page.get("CommonPrefixes", [])
            )
            if len(found) > MAX_LISTED:
                raise CheckpointError(
                    f"{self._root}: more than {MAX_LISTED} names under the prefix; a checkpoint "
                    f"holds fewer: point at the checkpoint's own prefix",
                    path=self._root,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        found.discard("")
        return sorted(found)

    def entry(self, name: str) -> Entry | None:
        """The object at ``name`` (a ``HEAD``), a folder when keys lie under ``name/``, or
        ``None`` when neither is there."""
        try:
            return Entry(name, "file", self.stamp(name))
        except CheckpointNotFoundError:
            pass
        key = self.resolve(name)
        page = attempt(
            self.settings,
            self.counts,
            lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=f"{key}/", MaxKeys=1),
            what=f"listing {self.url(name)}/",
            where=self.url(name),
        )
        self.counts.add(lists=1)
        if page.get("KeyCount", 0) or page.get("Contents"):
            return Entry(name, "directory", FileStamp(0, 0, 0, 0))
        return None

    def stamp(self, name: str) -> FileStamp:
        """The object's identity: size, ETag, version and last modification (a ``HEAD``).

        Raises:
            CheckpointNotFoundError: No object is there (``file.missing``).
            CheckpointError: The store refused or failed (retried first).
        """
        key = self.resolve(name)
        response = attempt(
            self.settings,
            self.counts,
            lambda: self._client.head_object(Bucket=self.bucket, Key=key),
            what="HEAD",
            where=self.url(name),
            missing=name,
        )
        self.counts.add(heads=1)
        modified = response.get("LastModified")
        return FileStamp(
            size=int(response["ContentLength"]),
            mtime_ns=int(modified.timestamp() * 1e9) if modified is not None else 0,
            inode=0,
            device=0,
            etag=str(response.get("ETag") or ""),
            version=str(response.get("VersionId") or ""),
        )

    def passes_through(self, name: str) -> frozenset[tuple[int, int]]:
        """Nothing: an object store has no links."""
        return frozenset()

    def open_file(
        self,
        name: str,
        *,
        expected: str,
        not_regular_rule: RuleId | None = "file.not_regular",
        prefetch: int = 0,
    ) -> S3File:
        """The object at ``name``, its current ETag pinned for every read.

        Args:
            name: The object, relative to the prefix.
            expected: What it should be, for messages (unused: an object is always one).
            not_regular_rule: Unused: a store has nothing but objects.
            prefetch: Bytes from the object's start to fetch now: one ranged GET then
                stamps the object (size, ETag, version, from its answer) and keeps them,
                where ``0`` makes a ``HEAD`` (a round trip less per header or index).

        Raises:
            CheckpointNotFoundError: No object is there (``file.missing``).
            CheckpointError: The store refused or failed (retried first), or answered
                another range than the one asked for.
        """
        if prefetch <= 0:
            return S3File(self, name, self.stamp(name))
        with self._ahead_lock:
            ahead = self._ahead.pop((name, prefetch), None)
            if self._ahead_pool is not None:  # opens ahead may still name it
                self._taken.add((name, prefetch))
        if ahead is not None:
            return ahead.result()  # opened ahead (or its error, raised here)
        return self._open_fetching(name, prefetch)

    def open_ahead(
        self,
        names: Iterable[str],
        *,
        prefetch: int,
        then: Callable[[S3File], Iterable[str]] | None = None,
        then_prefetch: int = 0,
    ) -> None:
        """Start opening ``names`` in the background, each as :meth:`open_file` with
        ``prefetch`` would; the first such :meth:`open_file` of one takes the result (the
        object, or the error, raised then).  Results nobody takes cost their GET only; an
        object :meth:`open_file` has opened already is not opened again.

        Args:
            names: Objects to open, relative to the prefix.
            prefetch: Bytes from each object's start fetched with it.
            then: Called with each object opened here; the names it gives are opened ahead
                too (an index names its files).
            then_prefetch: Bytes fetched with each object ``then`` names.
        """
        with self._ahead_lock:
            if self._ahead_closing:
                return
            if self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(_AHEAD_THREADS)
            for name in names:
                if (name, prefetch) not in self._ahead and (name, prefetch) not in self._taken:
                    self._ahead[name, prefetch] = self._ahead_pool.submit(
                        self._open_then, name, prefetch, then, then_prefetch
                    )

    def _open_then(
        self,
        name: str,
        prefetch: int,
        then: Callable[[S3File], Iterable[str]] | None,
        then_prefetch: int,
    ) -> S3File:
        file = self._open_fetching(name, prefetch)
        if then is not None:
            self.open_ahead(then(file), prefetch=then_prefetch)
        return file

    def close_ahead(self) -> None:
        """Cancel the opens ahead not yet started and wait for the others; forget them all."""
        with self._ahead_lock:
            pool, self._ahead_pool = self._ahead_pool, None
            self._ahead_closing = True  # an open finishing now starts no more
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._ahead_lock:
            self._ahead.clear()
            self._taken.clear()
            self._ahead_closing = False

    def _open_fetching(self, name: str, prefetch: int) -> S3File:
        """See :meth:`open_file`: the object stamped by a GET of its first bytes."""
        from botocore.exceptions import ClientError

        key = self.resolve(name)
        where = self.url(name)
        what = f"GET bytes 0-{prefetch - 1}"
        opened: list[tuple[FileStamp, bytes]] = []

        def one_try() -> dict[str, Any]:
            try:
                response = self._client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes=0-{prefetch - 1}"
                )
            except ClientError as err:
                status, code = status_of(err)
                if status == 416 or code == "InvalidRange":
                    return {}  # an empty object has no byte 0: a HEAD stamps it
                raise
            body = response["Body"]
            try:
                size = _opened_size(response, prefetch, where, what, name)
                buffer = bytearray(min(size, prefetch))
                got = stream(body, [memoryview(buffer)])
            finally:
                body.close()
            self.counts.add(gets=1, bytes=got)
            if got < len(buffer):
                raise Retry(f"a short body ({got} of {len(buffer)} bytes)")
            modified = response.get("LastModified")
            stamp = FileStamp(
                size=size,
                mtime_ns=int(modified.timestamp() * 1e9) if modified is not None else 0,
                inode=0,
                device=0,
                etag=str(response.get("ETag") or ""),
                version=str(response.get("VersionId") or ""),
            )
            opened.append((stamp, bytes(buffer)))
            return {}

        attempt(self.settings, self.counts, one_try, what=what, where=where, missing=name)
        if not opened:
            return S3File(self, name, self.stamp(name))
        stamp, head = opened[-1]
        return S3File(self, name, stamp, head=head)

    def open_unchanged(self, name: str, stamp: FileStamp, *, again: str) -> S3File:
        """The object whose header was read when ``stamp`` was taken, that ETag pinned: no
        request is made here, each read refuses another version (``If-Match``)."""
        if not stamp.etag:
            raise CheckpointChangedError(
                f"{self.url(name)}: its stamp carries no ETag, so a read could not be pinned to "
                f"the version whose header was read; {again}",
                path=name,
            )
        return S3File(self, name, stamp, again=again)

    def read_whole(
        self,
        name: str,
        *,
        expected: str,
        limit: int,
        over_limit: str,
        not_regular_rule: RuleId | None = None,
        over_limit_rule: RuleId | None = None,
    ) -> bytes:
        """The whole object, refused from its size (a ``HEAD``) when over ``limit``."""
        with self.open_file(name, expected=expected, prefetch=WHOLE_FIRST_READ) as file:
            if file.size > limit:
                raise CheckpointError(
                    f"{name}: {file.size} bytes; {over_limit}", path=name, rule=over_limit_rule
                )
            return file.read_exact(0, file.size)

    def _read_only(self, name: str) -> NoReturn:
        raise CheckpointError(
            f"{self.url(name)}: writing to object storage is not supported; write to a local "
            f"directory (consolidate from a bucket takes a local destination), then upload",
            path=name,
        )

    def create_exclusive(self, name: str) -> NewFile:
        """Refused: object storage is read only here."""
        self._read_only(name)

    def write_atomically(self, name: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Refused: object storage is read only here."""
        self._read_only(name)

    def remove(self, name: str) -> None:
        """Refused: object storage is read only here."""
        self._read_only(name)

    def sync(self) -> None:
        """Nothing to make durable: nothing is written."""


def _opened_size(response: dict[str, Any], prefetch: int, where: str, what: str, name: str) -> int:
    """The object's size from the answer to the GET of its first ``prefetch`` bytes, whose
    ``Content-Range`` and ``Content-Length`` are checked to be that range.

    Raises:
        CheckpointError: Another range, or a length that does not match it.
    """
    got_range = response.get("ContentRange")
    got_length = response.get("ContentLength")
    _, _, total = str(got_range or "").rpartition("/")
    size = int(total) if total.isdigit() else -1
    length = min(size, prefetch)
    if size <= 0 or got_range != f"bytes 0-{length - 1}/{size}" or got_length != length:
        raise CheckpointError(
            f"{where}: {what} answered Content-Range {got_range!r} and Content-Length "
            f"{got_length!r}, not the object's first bytes; the store (or a proxy in front of "
            f"it) answered another range: its bytes are not used",
            path=name,
        )
    return size
