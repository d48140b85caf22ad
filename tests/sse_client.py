"""Read a whole event stream over the real client transport, keeping every event and comment."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from replystream.client.transport import http_request
from replystream.sse import Event, EventParser


@dataclass
class Received:
    status: int
    headers: dict[str, str]
    events: list[Event] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    raw: bytes = b""

    def of_type(self, kind: str) -> list[Any]:
        return [json.loads(e.data) for e in self.events if e.type == kind]

    @property
    def text(self) -> str:
        return "".join(p["text"] for p in self.of_type("token"))

    @property
    def chat_text(self) -> str:
        """The content of every chat-completion chunk's deltas, in order."""
        parts = []
        for event in self.events:
            if event.type == "message" and event.data != "[DONE]":
                for choice in json.loads(event.data)["choices"]:
                    parts.append(choice["delta"].get("content") or "")
        return "".join(parts)

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]


async def post_events(url: str, body: dict[str, Any], headers: dict[str, str] | None = None):
    """POST ``body`` as JSON and read the response to its end."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    async with http_request(
        url, method="POST", body=json.dumps(body).encode(), headers=sent
    ) as response:
        got = Received(response.status, response.headers)
        parser = EventParser()
        raw = bytearray()
        async for chunk in response:
            raw += chunk.data
            for event in parser.feed(chunk.data):
                got.events.append(event)
                got.arrivals.append(time.perf_counter())
        got.raw = bytes(raw)
        return got
