"""A keep-alive HTTP/1.1 GET over one connection, parsed by httptools (llhttp).

Why not aiohttp for scrapes: at fleet scale the scrape loop runs 20 times a second per
endpoint, and aiohttp's client machinery (request and response objects, the connector,
the timeout context, the stream reader) costs a couple of hundred microseconds of CPU
per request, which for 500 endpoints is more than a core by itself. A scrape needs only
"send these bytes, collect the body": one asyncio protocol per endpoint, the response
parsed by httptools (llhttp, which uvicorn ships with), one timer per request.

Only what a metrics endpoint needs: GET, no request body, identity or chunked responses,
no redirects, no TLS. A connection that fails, times out or is closed by the server is
dropped and redialled on the next request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools

#: A body larger than this is refused (a metrics page is tens of KB).
MAX_BODY = 16 << 20


class HttpError(Exception):
    pass


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: list[bytes] = []
        self.size = 0
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.keep_alive = True

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(HttpError(f"bad HTTP response: {error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"connection closed: {exc}" if exc else "connection closed"))

    # -- httptools callbacks --------------------------------------------------------------
    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_BODY:
            self._fail(HttpError(f"response body over {MAX_BODY} bytes"))
            return
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        body = b"".join(self.chunks)
        self.chunks, self.size = [], 0
        self.keep_alive = self.parser.should_keep_alive()
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))
        if not self.keep_alive:
            self.close()

    # -- ours -----------------------------------------------------------------------------
    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def _fail(self, error: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class KeepAliveGet:
    """``await get()`` → (status, body) of ``GET path`` on ``host:port``, one connection."""

    def __init__(self, host: str, port: int, path: str, timeout: float) -> None:
        self.host = host.strip("[]")
        self.port = port
        self.timeout = timeout
        authority = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\n"
            "User-Agent: infergate-epp\r\n\r\n"
        ).encode()
        self._conn: _Connection | None = None

    async def get(self) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        conn = self._conn
        try:
            async with asyncio.timeout(self.timeout):
                if conn is None or conn.closed:
                    _, conn = await loop.create_connection(_Connection, self.host, self.port)
                    self._conn = conn
                return await conn.request(self._request)
        except BaseException:
            if conn is not None:  # timed out or failed mid-response: the stream is unusable
                conn.close()
            self._conn = None
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
