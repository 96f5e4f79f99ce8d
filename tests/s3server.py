"""A local S3-compatible server for tests and benchmarks: moto's, in a child process.

Needs the ``test`` extra (``moto[server]``).  The server listens on ``127.0.0.1`` on a port
the kernel chooses and lives until :meth:`LocalS3.stop` (or the end of a ``with`` block);
it runs in a process of its own so that the process that loads does not share its
interpreter lock with the server.  Nothing here reaches the network.

Objects are held in memory, and a GET hands the object's bytes to the response without
copying them first: a ranged GET costs its range, as on a store serving from its page
cache.  moto as shipped copies the whole object for every GET (its ``FakeKey.value``
reads the object's spooled buffer, on disk past 5 MiB), so a GET of 8 bytes from a 64 MiB
object cost ~45 ms of server CPU and every row of a benchmark paid the object's size per
request; :attr:`LocalS3.zero_copy` says whether that was avoided (``docs/benchmarks/s3_load.md``).

    with LocalS3.start() as server:
        server.put("bucket", "ckpt/model.safetensors", data)
        layout = hyperckpt.describe("s3://bucket/ckpt", options=server.options())
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Final

__all__ = ["CREDENTIALS", "LocalS3"]

#: What the local server accepts; real credentials never travel to it.
CREDENTIALS: Mapping[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

#: Objects up to this size stay in memory (moto's own limit is about 5 MiB, then disk).
_IN_MEMORY_BYTES: Final = 2**40

_CHILD = """
import io
import logging
import sys
from moto.s3.models import FakeKey
from moto.server import ThreadedMotoServer

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
copying = FakeKey.value


def shared(key):
    # The object's bytes, shared rather than copied (bytes are immutable: a later write
    # to the key replaces them, it never changes what a response holds).
    with key.lock:
        buffer = getattr(key._value_buffer, "_file", None)
        if isinstance(buffer, io.BytesIO):
            return buffer.getvalue()
    return copying.fget(key)


zero_copy = isinstance(copying, property) and copying.fset is not None
if zero_copy:
    FakeKey.value = property(shared, copying.fset)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
# The port and whether GETs share the object's bytes, for the parent.
sys.stdout.write(f"{server.get_host_and_port()[1]} {int(zero_copy)}\\n")
sys.stdout.flush()
sys.stdin.read()  # until the parent closes it (or exits)
server.stop()
"""


class LocalS3:
    """A running local S3-compatible server.

    Attributes:
        endpoint: Its URL, ``http://127.0.0.1:<port>``.
        zero_copy: Whether a GET shares the object's bytes (a ranged GET costs its range);
            ``False`` where moto's ``FakeKey`` is not as expected, and a GET copies the
            whole object first, as moto does.
    """

    def __init__(self, process: subprocess.Popen[str], endpoint: str, *, zero_copy: bool) -> None:
        self._process = process
        self.endpoint = endpoint
        self.zero_copy = zero_copy

    @classmethod
    def start(cls) -> LocalS3:
        """Start a server and wait until it listens.

        Raises:
            RuntimeError: It did not start (moto missing: ``pip install hyperckpt[test]``).
        """
        # Its stderr goes to a file: a pipe nobody reads would fill and stop the server.
        with tempfile.TemporaryFile(mode="w+") as errors:
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                env={**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(_IN_MEMORY_BYTES)},
            )
            assert process.stdout is not None
            port, _, zero_copy = process.stdout.readline().strip().partition(" ")
            if not port.isdigit():
                process.kill()
                process.wait()
                errors.seek(0)
                raise RuntimeError(
                    f"the local S3 server did not start (is moto[server] installed? pip "
                    f"install hyperckpt[test]): {errors.read().strip()[-2000:]}"
                )
        return cls(process, f"http://127.0.0.1:{port}", zero_copy=zero_copy == "1")

    def cpu_seconds(self) -> float:
        """CPU time the server's process has used so far (user and system; Linux)."""
        with open(f"/proc/{self._process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def environment(self) -> dict[str, str]:
        """The variables a client needs to reach this server (test credentials included)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self, endpoint: str | None = None) -> object:
        """A boto3 S3 client of this server (or of ``endpoint``, a proxy in front of it)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def upload(self, bucket: str, prefix: str, folder: str | os.PathLike[str]) -> list[str]:
        """Create ``bucket`` if needed and copy every file directly in ``folder`` under
        ``prefix``; the keys written."""
        client = self.client()
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}  # type: ignore[attr-defined]
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
        keys = []
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                key = f"{prefix.rstrip('/')}/{path.name}" if prefix else path.name
                self.put(bucket, key, path.read_bytes())
                keys.append(key)
        return keys

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Write one object (the bucket must exist, see :meth:`upload` or :meth:`bucket`)."""
        self.client().put_object(Bucket=bucket, Key=key, Body=data)  # type: ignore[attr-defined]

    def bucket(self, name: str) -> None:
        """Create the bucket ``name``."""
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]

    def keys(self, bucket: str) -> Iterable[str]:
        """Every key of ``bucket``."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)  # type: ignore[attr-defined]
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        """Stop the server (its objects are gone)."""
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> LocalS3:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
