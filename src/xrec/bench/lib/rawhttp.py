"""A minimal HTTP/1.1 keep-alive client for load generation on the same machine.

The server and its load share the cores here, so the client must cost little:
bodies are encoded once, responses are read by Content-Length without parsing
JSON (only the status line). Only 127.0.0.1 is a target.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    status: int          # 0: the connection failed before an answer
    start: float
    end: float
    num_bytes: int


class Connection:
    """One keep-alive connection; one request at a time."""

    def __init__(self, host: str, port: int):
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"load targets 127.0.0.1 only, got {host!r}")
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: str = "") -> Answer:
        """One request. A kept-alive connection that the server closed while it was idle
        (it ends before a status line) is retried once on a new connection, as HTTP clients
        do; the answer's start stays the first try's."""
        start = time.perf_counter()
        is_reused = self.writer is not None
        status, length = await self._post(path, body, headers)
        if status is None and is_reused:
            status, length = await self._post(path, body, headers)
        return Answer(status or 0, start, time.perf_counter(), length)

    async def _post(self, path: str, body: bytes, headers: str) -> tuple[int | None, int]:
        """(status, body length); status 0 for a failure, None when the connection ended
        (closed or reset) before the status line."""
        status_line = b""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n{headers}\r\n").encode()
            self.writer.write(head + body)
            status_line = await self.reader.readline()
            if not status_line:
                await self.close()
                return None, 0
            version, status = status_line.split()[0], int(status_line.split()[1])
            length, is_close = 0, version == b"HTTP/1.0"   # 1.0 closes unless it says otherwise
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
                elif name.lower() == "connection":
                    is_close = value.strip().lower() != "keep-alive"
            await self.reader.readexactly(length)
            if is_close:
                await self.close()
            return status, length
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
            await self.close()
            return (None if isinstance(e, ConnectionError) and not status_line else 0), 0

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


async def burst(host: str, port: int, path: str, bodies: list[bytes],
                connections: list[Connection] | None = None) -> list[Answer]:
    """Send every body at once, one connection each; the answers in body order."""
    connections = connections or [Connection(host, port) for _ in bodies]
    return list(await asyncio.gather(*[c.post(path, b) for c, b in zip(connections, bodies)]))
