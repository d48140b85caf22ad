"""A bare HTTP/1.1 client on a raw socket, for tests that must control every read."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class RawResponse:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    async def read_head(self) -> None:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                self.headers[name.strip().lower()] = value.strip()

    async def read_body(self, *, close: bool = True) -> bytes:
        """The whole body, de-chunked (for chunked responses) or up to EOF; then close,
        unless ``close`` is False (a keep-alive connection that carries more requests)."""
        try:
            return await self._read_body()
        finally:
            if close:
                await self.aclose()

    async def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding") == "chunked":
            body = bytearray()
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    return bytes(body)
                body += await self.reader.readexactly(size + 2)
                del body[-2:]
        if "content-length" in self.headers:
            return await self.reader.readexactly(int(self.headers["content-length"]))
        return await self.reader.read()

    async def aclose(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


async def raw_request(
    url: str, method: str = "GET", body: bytes = b"", headers: dict[str, str] | None = None
) -> RawResponse:
    """Send one request on a fresh connection and read the status line and headers."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    headers = {"Host": parts.netloc} | (headers or {})  # a Host given replaces the URL's
    lines = [f"{method} {target} HTTP/1.1", "Connection: close"]
    for name, value in headers.items():
        lines.append(f"{name}: {value}")
    if body:
        lines.append(f"Content-Length: {len(body)}")
    response = RawResponse(reader, writer)
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await writer.drain()
        await response.read_head()
    except BaseException:
        writer.close()  # a cancelled or failed request drops its connection
        raise
    return response
