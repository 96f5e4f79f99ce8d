"""A fault-injecting HTTP proxy in front of the local S3 server, and the tests' S3 fixtures.

:class:`FaultProxy` forwards every request to the server unchanged, except the ranged GETs
it is told to spoil, one queued fault per GET, in order: ``"503"`` (a throttling answer),
``"drop"`` (the connection closed before any answer), ``"short"`` (half the body, then the
connection closed), ``"slow"`` (no answer for ``slow_s`` seconds), ``"range"`` (another
``Content-Range`` than the one asked for) and ``"long"`` (a body one byte longer than
asked, with a ``Content-Length`` to match).  A fault of ``"503*"`` spoils every GET from
then on.  It counts the GETs it saw.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from s3server import LocalS3

__all__ = ["FaultProxy", "s3_env", "s3_server"]


class FaultProxy:
    """A proxy on ``127.0.0.1`` spoiling the ranged GETs as :attr:`faults` says.

    Attributes:
        endpoint: Its URL (give it to the client in place of the server's).
        faults: Faults still to apply, one per ranged GET, first first.
        gets: Ranged GETs seen (spoiled ones included).
        slow_s: How long a ``"slow"`` GET waits before it answers.
    """

    def __init__(self, upstream: str) -> None:
        self.faults: list[str] = []
        self.gets = 0
        self.slow_s = 2.0
        self._lock = threading.Lock()
        proxy = self
        target = urlsplit(upstream)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = None
                if self.command == "GET" and "Range" in self.headers:
                    with proxy._lock:
                        proxy.gets += 1
                        if proxy.faults:
                            fault = proxy.faults[0]
                            if not fault.endswith("*"):
                                proxy.faults.pop(0)
                if fault in ("503", "503*"):
                    self._answer(503, b"<Error><Code>SlowDown</Code></Error>")
                    return
                if fault == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if fault == "slow":
                    time.sleep(proxy.slow_s)
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    connection.request(self.command, self.path, body, dict(self.headers))
                    response = connection.getresponse()
                    data = response.read()
                    headers = response.getheaders()
                finally:
                    connection.close()
                if fault == "range":
                    headers = [
                        (k, "bytes 0-" + v.split("-", 1)[1].split("/")[0] + "/" + v.split("/")[1])
                        if k.lower() == "content-range"
                        else (k, v)
                        for k, v in headers
                    ]
                if fault == "long":
                    data += b"\0"
                self.send_response(response.status)
                head = self.command == "HEAD"  # its Content-Length is the object's size
                for key, value in headers:
                    dropped = (
                        "transfer-encoding",
                        "connection",
                        *(() if head else ("content-length",)),
                    )
                    if key.lower() not in dropped:
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "short":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(data)

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/xml")
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3]:
    """A local S3-compatible server (moto, a child process) for the whole session."""
    with LocalS3.start() as server:
        yield server


@pytest.fixture
def s3_env(s3_server: LocalS3, monkeypatch: pytest.MonkeyPatch) -> LocalS3:
    """The server, with the environment pointing every client (spawned ranks too) at it."""
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    return s3_server
