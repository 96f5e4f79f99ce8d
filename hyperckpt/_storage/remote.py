"""Object storage behind the storage protocols: ``s3://bucket/prefix`` read by ranged GETs.

:class:`S3Storage` is a checkpoint "directory" in an S3 bucket (or an S3-compatible store):
names are keys under the prefix, an entry's stamp comes from a ``HEAD`` (size, ETag,
version, last modification), and an :class:`S3File` reads exact byte ranges with one ranged
``GET`` each, the object's ETag pinned (``If-Match``): an object replaced after its stamp
was taken answers ``412`` and is refused as changed, so bytes of two versions never mix.

Every response is checked before a byte is used: the status, ``Content-Range`` (the range
asked for, of an object of the stamped size) and the body's length; a body that ends early
(a dropped connection) is fetched again.  Throttling, ``5xx`` answers, timeouts and dropped
connections are retried with a bounded, jittered exponential backoff, then refused naming
the object, the range and the last error (never a credential).  Writing is refused: a
consolidation from a bucket writes to a local directory.

The client is boto3 (the ``s3`` extra: ``pip install hyperckpt[s3]``), chosen by
measurement (``docs/design.md``, "Object storage"); endpoint, region and credentials come
the standard way (``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, the
credential chain).  No torch.
"""

from __future__ import annotations

import http.client
import logging
import os
import posixpath
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, NoReturn

from hyperckpt._storage.protocol import Entry
from hyperckpt._storage.stamp import FileStamp, stamp_changes
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

logger = logging.getLogger(__name__)

#: URL schemes read from object storage.
SCHEMES: Final = ("s3://",)
#: Keys listed at most in one folder: more than any checkpoint holds.
MAX_LISTED: Final = 100_000
#: Bytes of the GET that opens a small whole object (an index): most are read in one.
WHOLE_FIRST_READ: Final = 256 * 2**10
#: Objects opened ahead at once.
_AHEAD_THREADS: Final = 32
#: HTTP statuses worth a retry: throttling, server errors.
_RETRY_STATUS: Final = frozenset({408, 429, 500, 502, 503, 504})
#: Error codes worth a retry whatever their status.
_RETRY_CODES: Final = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}
)
_INSTALL: Final = "pip install hyperckpt[s3]"


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


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """How requests to object storage are made and retried.

    Attributes:
        attempts: Tries of one request, the first included (at least 1).
        backoff_s: Wait before the first retry in seconds; doubled after each, jittered.
        backoff_cap_s: Longest wait between two tries, in seconds.
        connect_timeout_s: Seconds to open a connection.
        read_timeout_s: Seconds without a byte on an open connection before the try fails.
        connections: Connections kept open to the store (at least the requests in flight).
    """

    attempts: int = 6
    backoff_s: float = 0.1
    backoff_cap_s: float = 5.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    connections: int = 64


@dataclass(slots=True)
class RequestCounts:
    """Requests made by one :class:`S3Storage` (all its files, all threads).

    Attributes:
        gets: Ranged GETs answered with data.
        heads: HEAD requests.
        lists: LIST pages.
        retries: Tries that failed and were made again.
        bytes: Body bytes received by GETs.
    """

    gets: int = 0
    heads: int = 0
    lists: int = 0
    retries: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        """Add to the named counters."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


class _Retry(Exception):
    """A try failed in a way worth another: ``reason`` says how, for the final message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


#: One client per settings and environment: making one costs tens of milliseconds, and a
#: client is safe to share between threads.
_CLIENTS: dict[tuple[object, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
#: What a client is made from besides the settings (never a secret).
_CLIENT_ENV: Final = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
)


def _client(settings: RemoteSettings, url: str) -> Any:
    key = (settings, *(os.environ.get(name) for name in _CLIENT_ENV))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _new_client(settings, url)
        return client


def _new_client(settings: RemoteSettings, url: str) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as err:
        raise CheckpointError(
            f"{url}: reading a checkpoint from object storage needs boto3, which is not "
            f"installed: {_INSTALL}",
            path=url,
        ) from err
    config = Config(
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.read_timeout_s,
        max_pool_connections=settings.connections,
        retries={"total_max_attempts": 1},  # the retries are ours (they cover bodies too)
    )
    return boto3.session.Session().client("s3", config=config)


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
        self._client: Any = client if client is not None else _client(self.settings, url)
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
            page = self.attempt(
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
        page = self.attempt(
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
        response = self.attempt(
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
                status, code = _status(err)
                if status == 416 or code == "InvalidRange":
                    return {}  # an empty object has no byte 0: a HEAD stamps it
                raise
            body = response["Body"]
            try:
                size = _opened_size(response, prefetch, where, what, name)
                buffer = bytearray(min(size, prefetch))
                got = _stream(body, [memoryview(buffer)])
            finally:
                body.close()
            self.counts.add(gets=1, bytes=got)
            if got < len(buffer):
                raise _Retry(f"a short body ({got} of {len(buffer)} bytes)")
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

        self.attempt(one_try, what=what, where=where, missing=name)
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

    def attempt(
        self,
        request: Callable[[], dict[str, Any]],
        *,
        what: str,
        where: str,
        missing: str | None = None,
        again: str | None = None,
    ) -> dict[str, Any]:
        """Call ``request`` until it succeeds or the tries run out.

        Args:
            request: A callable making one try; it may raise ``_Retry`` itself (a short
                body).
            what: The request, for messages (``"GET bytes 0-7"``).
            where: The object's URL, for messages.
            missing: The name refused as missing on a ``404`` (``HEAD``); ``None``: a
                ``404`` means the object went away (a read after its stamp was taken).
            again: What a changed object means and what to do (reads).

        Raises:
            CheckpointNotFoundError: ``404`` and ``missing`` is given.
            CheckpointChangedError: ``412`` (another version), or ``404`` on a read.
            CheckpointError: A refusal (``403``, ``400``), or the tries ran out.
        """
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
        )

        settings = self.settings
        last = ""
        for attempt in range(max(1, settings.attempts)):
            if attempt:
                self.counts.add(retries=1)
                wait = min(settings.backoff_cap_s, settings.backoff_s * 2 ** (attempt - 1))
                time.sleep(wait * (0.5 + random.random() / 2))
            try:
                return request()
            except _Retry as err:
                last = err.reason
            except ClientError as err:
                status, code = _status(err)
                if status == 412 or code == "PreconditionFailed":
                    raise CheckpointChangedError(
                        f"{where}: another version of the object is there now ({what} answered "
                        f"412 for the ETag whose header was read); "
                        f"{again or 'it was replaced meanwhile: start again'}",
                        path=where,
                    ) from None
                if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
                    if missing is not None:
                        raise CheckpointNotFoundError(
                            f"{where}: no such object; a file of the checkpoint is missing "
                            f"(check the bucket and prefix)",
                            path=missing,
                            rule="file.missing",
                        ) from None
                    raise CheckpointChangedError(
                        f"{where}: the object is gone ({what} answered 404) though it was there "
                        f"when its header was read; {again or 'start again'}",
                        path=where,
                    ) from None
                if status == 416 or code == "InvalidRange":
                    raise CheckpointChangedError(
                        f"{where}: {what} is past the object's end (416); the object is shorter "
                        f"than when its header was read; {again or 'start again'}",
                        path=where,
                    ) from None
                if status in _RETRY_STATUS or code in _RETRY_CODES:
                    last = f"{status} {code}"
                    continue
                raise CheckpointError(
                    f"{where}: {what} refused by the store ({status} {code}); check the "
                    f"bucket, the prefix and the permissions of the credentials in use",
                    path=where,
                ) from None
            except NoCredentialsError:
                raise CheckpointError(
                    f"{where}: no credentials for object storage; set them the standard way "
                    f"(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an "
                    f"instance role)",
                    path=where,
                ) from None
            except (ConnectionError, HTTPClientError, IncompleteReadError) as err:
                # Dropped connections, timeouts, bodies cut short: worth another try.
                last = type(err).__name__
            except BotoCoreError as err:
                raise CheckpointError(
                    f"{where}: {what} failed: {type(err).__name__}", path=where
                ) from None
            logger.debug("hyperckpt: %s of %s failed (%s), retrying", what, where, last)
        raise CheckpointError(
            f"{where}: {what} failed {settings.attempts} times, the last with {last}; the "
            f"store is unreachable, overloaded or failing: check the endpoint and the "
            f"network, then start again",
            path=where,
        )


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


def _status(err: Exception) -> tuple[int, str]:
    response = getattr(err, "response", {}) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(response.get("Error", {}).get("Code") or "")
    return status, code


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
                got = _stream(body, buffers)
            finally:
                body.close()
            storage.counts.add(gets=1, bytes=got)
            if got < length:
                raise _Retry(f"a short body ({got} of {length} bytes)")
            return {}

        storage.attempt(one_try, what=what, where=where, again=self._again)

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


#: Most bytes asked of a response body at once where its socket cannot be read directly.
#: The HTTP stack under boto3 answers a ``readinto`` by reading into a new buffer of the
#: asked size and copying it: a piece of this size is reused from the allocator's heap,
#: where a GET-sized one is fresh memory (page faults) each time.
STREAM_PIECE = 2**20


def _stream(body: Any, buffers: list[memoryview]) -> int:
    """Read ``body`` into ``buffers`` in order until they are full or it ends; the bytes read.

    The bytes go from the socket straight into the buffers where the response under boto3's
    body is the standard library's (``http.client``), as it is with urllib3: boto3's own
    ``readinto`` reads each piece into a new buffer and copies it (a quarter of a load's
    CPU on a local store, ``docs/benchmarks/s3_load.md``).  Elsewhere the body is read in
    pieces of :data:`STREAM_PIECE`.

    Raises:
        _Retry: The connection failed or timed out while the body was read.
    """
    raw: Any = getattr(body, "_raw_stream", None)
    direct: http.client.HTTPResponse | None = getattr(raw, "_fp", None)
    if not isinstance(direct, http.client.HTTPResponse) or direct.chunked:
        direct = None
    read = body.readinto if direct is None else direct.readinto
    piece = STREAM_PIECE if direct is None else 2**62
    done = 0
    try:
        for buffer in buffers:
            filled = 0
            while filled < len(buffer):
                got = read(buffer[filled : filled + piece])
                if not got:
                    return done + filled
                filled += got
            done += filled
    except OSError as err:  # a reset or a timeout on the socket itself (the direct path)
        raise _Retry(type(err).__name__) from None
    if direct is not None and direct.isclosed():
        raw.release_conn()  # the whole body was read: the connection serves the next GET
    return done
