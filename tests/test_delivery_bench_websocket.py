"""The delivery benchmark's WebSocket streams: frames walked right however reads split them,
and the same replies as SSE counted end to end from replystream and the bare peer.

The frame-walking tests feed ``WsStream`` a server's bytes cut at every offset (the kernel may
hand a read over anywhere); the end-to-end tests start each server in its own process and run
the real load client over loopback sockets.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import pytest

DELIVERY = Path(__file__).resolve().parent.parent / "benchmarks" / "delivery"
sys.path.insert(0, str(DELIVERY))

from clientstream import Run  # noqa: E402
from run import run_client  # noqa: E402
from servers import check_wire, started_server  # noqa: E402
from workload import (  # noqa: E402
    WS_TAG,
    request_body,
    stream_seeds,
    ws_done_message,
    ws_message,
    ws_reply_message,
    ws_token_message,
)
from wsclient import CLOSE, PING, PONG, TEXT, WsStream  # noqa: E402

UPGRADED = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


def server_frame(first: int, payload: bytes) -> bytes:
    """An unmasked frame, as a server sends it."""
    size = len(payload)
    if size < 126:
        return bytes([first, size]) + payload
    if size < 1 << 16:
        return bytes([first, 126]) + size.to_bytes(2, "big") + payload
    return bytes([first, 127]) + size.to_bytes(8, "big") + payload


def unmask(frame: bytes) -> tuple[int, bytes]:
    """A client frame's first byte and payload (client frames are masked, lengths < 126)."""
    assert frame[1] & 0x80, "a client frame must be masked"
    size = frame[1] & 0x7F
    mask, payload = frame[2:6], frame[6 : 6 + size]
    return frame[0], bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


class Recorder:
    """A transport that keeps what the stream writes."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


def fed(chunks: list[bytes]) -> tuple[WsStream, Run, Recorder]:
    run = Run(1)
    stream = WsStream(run, b"GET /v1/ws ...", ws_reply_message(WS_TAG, 7))
    recorder = Recorder()
    stream.connection_made(recorder)  # type: ignore[arg-type]
    for chunk in chunks:
        stream.data_received(chunk)
    return stream, run, recorder


def reply_bytes(tokens: int, *, ping: bool = False) -> bytes:
    """A server's side of one reply: upgrade, ``reply``, tokens (a long one), usage, done."""
    rid = "x" * 24
    frames = [server_frame(TEXT, ws_message("reply", WS_TAG, rid, 1, {}).encode())]
    for index in range(tokens):
        frames.append(server_frame(TEXT, ws_token_message(WS_TAG, rid, index).encode()))
        if ping and index == 1:
            frames.append(server_frame(PING, b"beat"))
    # A token whose message is longer than 125 bytes takes the 16-bit length form.
    long_text = {"text": "w" * 300, "tokens": 1}
    frames.append(server_frame(TEXT, ws_message("token", WS_TAG, rid, 99, long_text).encode()))
    frames.append(server_frame(TEXT, ws_message("usage", WS_TAG, rid, 100, {}).encode()))
    frames.append(server_frame(TEXT, ws_done_message(WS_TAG, rid, tokens, "length").encode()))
    return UPGRADED + b"".join(frames)


def splits(wire: bytes) -> list[list[bytes]]:
    """``wire`` cut once at every offset, then in reads of 1, 2, 3, 7 and 64 bytes."""
    cuts = [[wire[:k], wire[k:]] for k in range(1, len(wire))]
    return cuts + [[wire[i : i + n] for i in range(0, len(wire), n)] for n in (1, 2, 3, 7, 64)]


def test_ws_stream_counts_every_token_however_reads_split_the_frames() -> None:
    wire = reply_bytes(5, ping=True)
    for chunks in splits(wire):
        stream, run, recorder = fed(chunks)
        assert stream.failure is None and stream.ended and run.ended == 1
        assert len(stream.arrivals) == 6  # five tokens and the long one
        frames = [unmask(frame) for frame in recorder.written[1:]]
        assert frames[0] == (TEXT, ws_reply_message(WS_TAG, 7))  # the reply, after the 101
        assert (PONG, b"beat") in frames  # the ping answered with its payload
        assert frames[-1] == (CLOSE, (1000).to_bytes(2, "big"))  # closed after done
        assert not recorder.closed  # the server closes the connection, not the client


def test_ws_stream_reports_an_error_message_with_its_code() -> None:
    rid = "x" * 24
    error: dict[str, object] = {"error": {"message": "too slow", "code": "slow_client"}}
    wire = UPGRADED + server_frame(TEXT, ws_token_message(WS_TAG, rid, 0).encode())
    wire += server_frame(TEXT, ws_message("error", WS_TAG, rid, 3, error).encode())
    stream, run, recorder = fed([wire])
    assert stream.failure == "error message: slow_client"
    assert len(stream.arrivals) == 1 and recorder.closed
    assert run.failures == {"error message: slow_client": 1}


def test_ws_stream_reports_a_close_before_done_and_a_refused_upgrade() -> None:
    closed, _, _ = fed([UPGRADED + server_frame(CLOSE, (1008).to_bytes(2, "big") + b"slow")])
    assert closed.failure == "closed by the server with code 1008"
    refused, _, _ = fed([b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"])
    assert refused.failure == "status 400"


def test_ws_reply_asks_for_what_the_sse_request_asks_for() -> None:
    for seed in stream_seeds(3):
        for max_tokens in (None, 5):
            message = json.loads(ws_reply_message(WS_TAG, seed, max_tokens))
            assert message.pop("type") == "reply" and message.pop("id") == WS_TAG
            assert message == json.loads(request_body(seed, max_tokens))


@pytest.mark.parametrize("name", ["replystream", "bare"])
async def test_ws_load_client_counts_every_token_from_each_server(name: str) -> None:
    seeds = stream_seeds(8)
    async with started_server(name) as server:
        await check_wire(server, "ws")
        ws, sse = await asyncio.gather(
            run_client(server.url, seeds, 5, 30.0, "ws"),
            run_client(server.url, seeds, 5, 30.0, "sse"),
        )
    for result in (ws, sse):
        assert result["failures"] == {} and result["completed"] == len(seeds)
        assert result["events"] == 5 * len(seeds)
        # Lateness is measured against the same seeded schedule: nothing arrives early.
        assert result["lateness_ms"]["p50"] >= -5.0
    assert ws["upgrade_ms"]["p50"] >= 0.0 and math.isnan(sse["upgrade_ms"]["p50"])
