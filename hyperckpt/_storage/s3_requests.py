"""Requests to object storage: the client, the bounded retry loop, and bodies streamed into buffers.

Throttling, ``5xx`` answers, timeouts and dropped connections are retried with a jittered
exponential backoff, then refused naming the object, the range and the last error (never a
credential); every other answer becomes the error a caller would catch for it.  boto3 is
imported only when a client is made (the ``s3`` extra).  No torch.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from hyperckpt.errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError

__all__ = [
    "STREAM_PIECE",
    "RemoteSettings",
    "RequestCounts",
    "Retry",
    "attempt",
    "shared_client",
    "status_of",
    "stream",
]

logger = logging.getLogger(__name__)

#: HTTP statuses worth a retry: throttling, server errors.
_RETRY_STATUS: Final = frozenset({408, 429, 500, 502, 503, 504})
#: Error codes worth a retry whatever their status.
_RETRY_CODES: Final = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}
)
_INSTALL: Final = "pip install hyperckpt[s3]"


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
    """Requests made by one :class:`~hyperckpt._storage.remote.S3Storage` (all its files, all threads).

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


class Retry(Exception):
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


def shared_client(settings: RemoteSettings, url: str) -> Any:
    """The boto3 client for ``settings`` and the environment's endpoint and credentials,
    made on first use (``url`` names the checkpoint in the error when boto3 is missing)."""
    key = (settings, *(os.environ.get(name) for name in _CLIENT_ENV))
    with _CLIENTS_LOCK:
        made = _CLIENTS.get(key)
        if made is None:
            made = _CLIENTS[key] = _new_client(settings, url)
        return made


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


def attempt(
    settings: RemoteSettings,
    counts: RequestCounts,
    request: Callable[[], dict[str, Any]],
    *,
    what: str,
    where: str,
    missing: str | None = None,
    again: str | None = None,
) -> dict[str, Any]:
    """Call ``request`` until it succeeds or ``settings.attempts`` tries ran out.

    Args:
        settings: How many tries, and the waits between them.
        counts: Where the retries are counted.
        request: A callable making one try; it may raise :class:`Retry` itself (a short
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

    last = ""
    for tried in range(max(1, settings.attempts)):
        if tried:
            counts.add(retries=1)
            wait = min(settings.backoff_cap_s, settings.backoff_s * 2 ** (tried - 1))
            time.sleep(wait * (0.5 + random.random() / 2))
        try:
            return request()
        except Retry as err:
            last = err.reason
        except ClientError as err:
            status, code = status_of(err)
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


def status_of(err: Exception) -> tuple[int, str]:
    response = getattr(err, "response", {}) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(response.get("Error", {}).get("Code") or "")
    return status, code


#: Most bytes asked of a response body at once where its socket cannot be read directly.
#: The HTTP stack under boto3 answers a ``readinto`` by reading into a new buffer of the
#: asked size and copying it: a piece of this size is reused from the allocator's heap,
#: where a GET-sized one is fresh memory (page faults) each time.
STREAM_PIECE = 2**20


def stream(body: Any, buffers: list[memoryview]) -> int:
    """Read ``body`` into ``buffers`` in order until they are full or it ends; the bytes read.

    The bytes go from the socket straight into the buffers where the response under boto3's
    body is the standard library's (``http.client``), as it is with urllib3: boto3's own
    ``readinto`` reads each piece into a new buffer and copies it (a quarter of a load's
    CPU on a local store, ``docs/benchmarks/s3_load.md``).  Elsewhere the body is read in
    pieces of :data:`STREAM_PIECE`.

    Raises:
        Retry: The connection failed or timed out while the body was read.
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
        raise Retry(type(err).__name__) from None
    if direct is not None and direct.isclosed():
        raw.release_conn()  # the whole body was read: the connection serves the next GET
    return done
