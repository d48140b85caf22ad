"""A seeded random driver of reply lifecycles against real servers.

Many clients at once, each drawing (from its own seeded random source) a route to start a
reply on, how much of it to read before cutting the connection, and what else to do to the
reply meanwhile from other connections: resume it, cancel it, delete it, poll it, read it
again from an earlier event. Every route, the WebSocket's too, draws batching and a
moderation hold-back window, and the servers ban a phrase. Now and then a reply's first
reader is narrow (``tests/narrow_link``: a few KB of buffers between it and the server) and
stops keeping up early, stalling or trickling, until the server cuts it as a slow client:
it must then be told so in its dialect (``slow_client``) and its stream end there (a
WebSocket: the reply's ``error``, a close frame 1008), and the reply goes on for the others
(a resume after the cut finds it whole). Every reader's events are checked as they come:

- ids (and a response's sequence numbers) go up by one within a stream, from where it
  started; only an ending the reader itself was told (no id of its own) repeats the last;
- every reader that sees an event id sees the same text under it, and the text of a reply
  (of each of its choices), joined in id order, is a beginning of the simulated engine's text
  (which is fixed for a length) as its request's stop strings and the server's banned phrase
  cut it (``lifecycle_expect``): no text twice at a seam, none lost, no part of a stop string
  and never the whole banned phrase;
- a reply said complete has the whole text, and says it finished as its request makes it
  finish (its token limit, a stop string, moderation); a stored response polled has a
  beginning of it; each piece of text has its tokens' log probabilities when asked for;
- every request is answered within a generous bound, never with a 5xx, and a 4xx is in the
  route's error format.

With a server killed during the run, a reader it was serving reads on on a server alive,
and after the run every reply of the killed server that one can still tell of (a resumable
one, a stored response) is read to its end there, or polled until it ends: it must have
ended whole, or ``generator_lost`` (a response ``failed`` saying so).

After the run: the servers' gauges are back at their baseline and their logs hold no
ERROR and no traceback. ``run()`` returns the failures (with the seed: a run replays its
clients' plans, not the loop's exact timing).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from replystream.sse import EventParser
from tests.lifecycle_expect import (
    LONG_WORDS,
    MAX_TOKENS,
    Expected,
    expected,
    finishes,
    logprob_entries,
    logprob_problem,
    overlaps_ban,
    pieces,
    reference,
    response_finish,
)
from tests.narrow_link import NarrowResponse, RawWebSocket

HANG_S = 30.0  # no request of the driver may take longer than this
# How long a narrow reader keeps from reading (or reads a few bytes at a time): longer than
# the servers' --slow-client-s (1 s) and the time its buffers take to fill.
NARROW_S = 1.6
NARROW_SHARE = 0.08  # of the replies streamed (the WebSocket's too)


ROUTES = (
    "native",
    "native_whole",
    "chat",
    "chat_whole",
    "responses",
    "responses_bg_stream",
    "responses_bg",
    "responses_whole",
    "messages",
    "ws",
)
STREAMED = ("native", "chat", "responses", "responses_bg_stream", "messages")
# Nothing in a run evicts, expires or shuts down: these codes are wrong here.
UNEXPECTED_CODES = ("reply_evicted", "expired", "replay_store_unavailable", "internal_error")
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


@dataclass
class Reply:
    """What the driver knows of one reply, across all its readers."""

    seed: str
    route: str
    max_tokens: int
    resumable: bool
    reply_id: str | None = None
    n: int = 1  # choices
    stops: tuple[str, ...] = ()
    window: int = 0  # hold-back tokens asked for
    top_logprobs: int | None = None  # alternatives asked for with log probabilities
    # event id -> the (choice, text) pairs it carried
    texts: dict[int, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    finishes: set[tuple[int, str, str | None]] = field(default_factory=set)  # told
    complete_told: int = 0  # readers told it ended whole
    cancel_asked: bool = False
    deleted: bool = False
    final_ids: set[int] = field(default_factory=set)  # ids of terminal events
    odd_endings: list[str] = field(default_factory=list)  # not complete, none asked to stop
    stored: bool = True  # a response kept in the store (not ``store: false``)
    base: str = ""  # the server that started it
    body: str = ""  # the request that started it, for a failure's report
    left_alone: bool = False  # a resume came after a pause that may outlast the detach grace
    narrow: str | None = None  # its first reader is narrow and "stall"s or "trickle"s
    ends_told: int = 0  # readers (and polls) told how it ended, however it ended
    refused: list[str] = field(default_factory=list)  # requests about it answered 4xx

    @property
    def expect(self) -> Expected:
        return expected(self.max_tokens, self.stops, self.window)

    @property
    def dialect(self) -> str:
        if self.route.startswith("responses"):
            return "responses"
        if self.route.startswith("chat"):
            return "chat"
        if self.route == "messages":
            return "messages"
        return "native"

    @property
    def response_id(self) -> str:
        return f"resp_{self.reply_id}"


@dataclass
class Run:
    seed: int
    urls: list[str]
    failures: list[str] = field(default_factory=list)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    replies: list[Reply] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)  # servers killed during the run

    @property
    def live(self) -> list[str]:
        return [url for url in self.urls if url not in self.dead]

    def fail(self, reply: Reply | None, what: str) -> None:
        where = f"[{reply.seed} {reply.route} {reply.reply_id} {reply.body}] " if reply else ""
        self.failures.append(f"seed {self.seed} {where}{what}")


def ending_of(dialect: str, event_type: str, raw: str, data: Any) -> str | None:
    """How a stream ends at this event: ``complete``, ``cancelled``, ``error:CODE`` or
    ``failed:...``; None for an event that does not end it."""
    if dialect == "native":
        if event_type in ("done", "moderated"):
            return "complete"
        if event_type in ("error", "gap"):
            code = data.get("error", data).get("code") if isinstance(data, dict) else None
            return f"error:{code}" if event_type == "error" else event_type
        return None
    if dialect == "chat":
        if raw == "[DONE]":
            return "complete"
        if isinstance(data, dict) and "error" in data:
            return f"error:{data['error'].get('code')}"
        return None
    if dialect == "responses":
        if event_type in ("response.completed", "response.incomplete"):
            return "complete"
        if event_type == "response.failed":
            response = data["response"]
            if response["status"] == "cancelled":
                return "cancelled"
            return f"failed:{(response.get('error') or {}).get('message')}"
        if event_type == "error":
            return f"error:{data.get('code')}"
        return None
    if event_type == "message_stop":
        return "complete"
    if event_type == "error":
        error = data.get("error", {})
        return f"error:{error.get('code') or error.get('type')}"
    return None


class Driver:
    def __init__(self, run: Run, http: aiohttp.ClientSession) -> None:
        self.run = run
        self.http = http

    def url(self, rng: random.Random) -> str:
        return rng.choice(self.run.live)

    async def bounded(self, reply: Reply | None, what: str, call: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(HANG_S):
                return await call
        except TimeoutError:
            self.run.fail(reply, f"{what}: no answer within {HANG_S} s")
        except (aiohttp.ClientError, ConnectionError) as exc:
            self.run.counts[f"transport error {what}: {type(exc).__name__}"] += 1
            if what.startswith(("cancel", "delete", "poll")):
                self.run.fail(reply, f"{what}: {type(exc).__name__}: {exc}")
        return None

    async def check_status(
        self, reply: Reply | None, what: str, response: aiohttp.ClientResponse, anthropic: bool
    ) -> Any:
        """The body as JSON for a 2xx, else check the error and return None."""
        body = await response.read()
        self.run.counts[f"{what} {response.status}"] += 1
        if response.status >= 500:
            self.run.fail(reply, f"{what}: {response.status} {body[:300]!r}")
            return None
        try:
            parsed = json.loads(body)
        except ValueError:
            self.run.fail(reply, f"{what}: {response.status} not JSON: {body[:300]!r}")
            return None
        if response.status >= 400:
            error: dict[str, Any] = {}
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                error = parsed["error"]
            ok = "message" in error and "type" in error
            ok = ok and (parsed.get("type") == "error" if anthropic else "code" in error)
            if not ok:
                self.run.fail(reply, f"{what}: {response.status} not our error format: {body!r}")
            else:
                code = error.get("code") or error.get("type")
                self.run.counts[f"{what} {response.status} {code}"] += 1
                if code in UNEXPECTED_CODES:
                    self.run.fail(reply, f"{what}: {response.status} {error}")
            return None
        return parsed

    async def read_stream(
        self,
        reply: Reply,
        response: aiohttp.ClientResponse,
        after: int,
        stop_after: int | None,
        what: str,
        *,
        joined: bool = False,
    ) -> tuple[int, str | None]:
        """Read SSE events into ``reply`` until its end or ``stop_after`` events; return the
        last id read and how the stream ended (None: cut by us, or it just ended)."""
        where = f"{response.url.scheme}://{response.url.host}:{response.url.port}"
        chunks = response.content.iter_any()
        return await self.read_events(reply, chunks, where, after, stop_after, what, joined)

    async def read_events(
        self,
        reply: Reply,
        chunks: AsyncIterator[bytes],
        where: str,
        after: int,
        stop_after: int | None,
        what: str,
        joined: bool = False,
        narrow: bool = False,
    ) -> tuple[int, str | None]:
        """``read_stream`` of a body's chunks, read from ``where``; ``narrow``: a reader the
        server may cut as a slow client. A stream its server was killed under ends
        ``killed``."""
        parser = EventParser()
        last = after
        seen = 0
        dialect = reply.dialect
        read: list[str] = []  # the stream's events as id:type, for a failure's report
        lost_told: str | None = None  # a Responses reader told its producer is gone
        async for chunk in self.unless_killed(chunks, where):
            for event in parser.feed(chunk):
                read.append(f"{event.id}:{event.type}")
                raw = event.data
                data: Any = None
                if raw != "[DONE]":
                    try:
                        data = json.loads(raw)
                    except ValueError:
                        self.run.fail(reply, f"{what}: event not JSON: {raw[:200]!r}")
                        return last, "bad"
                ending = ending_of(dialect, event.type, raw, data)
                if lost_told:
                    # A lost producer's reader is told ``error``, then ``response.failed``.
                    if not (ending or "").startswith("failed:") or not lost(
                        data["response"]["error"]
                    ):
                        self.run.fail(reply, f"{what}: {event.type} after generator_lost")
                    return last, lost_told
                if joined and ending in ("gap", "error:events_lost"):
                    if dialect == "native":  # told of the hole: read on after it
                        last = json.loads(raw)["lost_to"]
                        continue
                    self.run.counts[f"join {dialect} {ending}"] += 1
                    return last, ending
                event_id = int(event.id) if event.id else last  # "": no id yet in this stream
                logged = event_id != last
                if logged and event_id != last + 1:
                    self.run.fail(
                        reply, f"{what}: id {event_id} after {last} ({event.type} {raw[:80]})"
                    )
                if not logged and not (ending or "").startswith(("error:", "failed:")):
                    self.run.fail(reply, f"{what}: unlogged {event.type} {raw[:120]!r}")
                if dialect == "responses" and isinstance(data, dict):
                    number = data.get("sequence_number")
                    if number != max(event_id, 1) - 1 and not (not logged and number == last - 1):
                        at = f"at id {event_id} ({event.type} {raw[:300]})"
                        self.run.fail(reply, f"{what}: sequence {number} {at}")
                if logged:
                    text = pieces(dialect, event.type, data)
                    known = reply.texts.setdefault(event_id, text)
                    if known != text:
                        self.run.fail(
                            reply, f"{what}: id {event_id} text {text!r}, another saw {known!r}"
                        )
                    for told in finishes(dialect, event.type, data):
                        reply.finishes.add(told)
                        self.run.counts[f"finish {dialect} {told[1]}"] += 1
                    if reply.top_logprobs is not None:
                        for piece, entries in logprob_entries(dialect, event.type, data):
                            problem = logprob_problem(piece, entries, reply.top_logprobs)
                            if problem:
                                self.run.fail(reply, f"{what}: id {event_id} {problem}")
                    if ending is not None:
                        reply.final_ids.add(event_id)
                    last = event_id
                if ending is not None:
                    if "generator_lost" in ending and dialect == "responses":
                        lost_told = ending
                    reply.ends_told += 1
                    if ending == "complete":
                        reply.complete_told += 1
                    elif not reply.cancel_asked and not (
                        reply.deleted
                        or ending.startswith("error:reply_stopped")
                        or (reply.base in self.run.dead and "generator_lost" in ending)
                        or (narrow and ending == "error:slow_client")
                    ):
                        reply.odd_endings.append(f"{what}: {ending}")
                    self.run.counts[f"ending {dialect} {ending}"] += 1
                    if lost_told:
                        continue
                    return last, ending
                seen += 1
                if stop_after is not None and seen >= stop_after:
                    return last, None
        if lost_told:
            self.run.fail(reply, f"{what}: no response.failed after {lost_told}")
            return last, lost_told
        if where in self.run.dead:
            self.run.counts[f"eof from the killed server {what}"] += 1
            return last, "killed"
        if not read and after in reply.final_ids:
            # Placed at the reply's last event (another reader saw it) before this server
            # knew it ended: it had it all, so its stream just ends (a 409 once known).
            self.run.counts[f"eof placed at the end {what}"] += 1
            return last, "eof"
        self.run.counts[f"eof without ending {what}"] += 1
        reply.odd_endings.append(
            f"{what}: eof after id {last} (from {where} after {after}, read {read[-8:]}; "
            f"started on {reply.base})"
        )
        return last, "eof"

    async def unless_killed(self, chunks: AsyncIterator[bytes], where: str) -> AsyncIterator[bytes]:
        """The chunks, ended where the connection fails because its server was killed."""
        try:
            async for chunk in chunks:
                yield chunk
        except (aiohttp.ClientError, ConnectionError):
            if where not in self.run.dead:
                raise
            self.run.counts["connection lost to the killed server"] += 1

    # --- starts -------------------------------------------------------------------------

    def start_body(self, reply: Reply, rng: random.Random) -> tuple[str, dict[str, Any]]:
        n = reply.max_tokens
        route = reply.route
        if route.startswith("native"):
            body: dict[str, Any] = {"prompt": "x", "max_tokens": n}
            if reply.stops:
                body["stop"] = list(reply.stops)
            if route == "native_whole":
                body["stream"] = False
            elif reply.resumable:
                body["resumable"] = True
            return "/v1/replies", body
        if route.startswith("chat"):
            body = {
                "model": "simulated",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": n,
                "stream": route == "chat",
            }
            if route == "chat" and reply.resumable:
                body["resumable"] = True
            if reply.stops:
                body["stop"] = list(reply.stops)
            if reply.n > 1:
                body["n"] = reply.n
            if reply.top_logprobs is not None:
                body.update(logprobs=True, top_logprobs=reply.top_logprobs)
            if route == "chat" and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            return "/v1/chat/completions", body
        if route == "messages":
            body = {
                "model": "simulated",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": n,
                "stream": True,
            }
            if reply.resumable:
                body["replystream"] = {"resumable": True}
            if reply.stops:
                body["stop_sequences"] = list(reply.stops)
            return "/v1/messages", body
        body = {"model": "simulated", "input": "x", "max_output_tokens": n}
        if reply.stops:
            body["replystream"] = {"stop": list(reply.stops)}
        if reply.top_logprobs is not None:
            body.update(include=["message.output_text.logprobs"], top_logprobs=reply.top_logprobs)
        if route == "responses":
            body["stream"] = True
            if rng.random() < 0.3:
                body["store"] = False
                reply.stored = False
        elif route == "responses_bg_stream":
            body.update(stream=True, background=True)
        elif route == "responses_bg":
            body["background"] = True
        return "/v1/responses", body

    def delivery(self, rng: random.Random) -> dict[str, Any]:
        """Random batching (its timers race the reply's end), or none."""
        extra: dict[str, Any] = {}
        if rng.random() < 0.3:
            extra["batch_tokens"] = rng.randint(1, 6)
        if rng.random() < 0.2:
            extra["batch_ms"] = rng.choice([0, 1, 5, 20])
        if rng.random() < 0.3:
            extra["holdback_tokens"] = rng.randint(0, 5)
        return extra

    async def episode(self, reply: Reply, rng: random.Random) -> None:
        """Start the reply, act on it from other connections meanwhile, check it after."""
        self.run.replies.append(reply)
        if reply.narrow and not self.resumable(reply):
            # Its reader cut as a slow client, it stops as when its client leaves.
            reply.cancel_asked = True
        if reply.route == "ws":
            await self.ws_episode(reply, rng)
            return
        path, body = self.start_body(reply, rng)
        extra = self.delivery(rng)
        reply.window = extra.get("holdback_tokens", 0)
        if extra and reply.dialect in ("responses", "messages"):
            body["replystream"] = {**body.get("replystream", {}), **extra}
        else:
            body.update(extra)
        reply.body = json.dumps({k: v for k, v in body.items() if k not in ("messages", "input")})
        base = reply.base = self.url(rng)
        stop_after = rng.choice([None, rng.randint(0, 12)])
        got_id = asyncio.Event()
        side: list[asyncio.Task[None]] = []
        async with asyncio.TaskGroup() as group:
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                side.append(group.create_task(self.side_action(reply, rng, got_id)))
            await self.bounded(
                reply, "start", self.start(reply, base, path, body, stop_after, rng, got_id)
            )
            got_id.set()  # a side action waiting for an id that never came goes on without
        if reply.route == "responses_bg" or (
            reply.route in ("responses", "responses_bg_stream")
            and body.get("store", True)
            and reply.reply_id
        ):
            await self.poll_until_ended(reply, rng)

    async def start(
        self,
        reply: Reply,
        base: str,
        path: str,
        body: dict[str, Any],
        stop_after: int | None,
        rng: random.Random,
        got_id: asyncio.Event,
    ) -> None:
        if reply.narrow:
            await self.start_narrow(reply, base, path, body, rng, got_id)
            return
        anthropic = reply.dialect == "messages"
        headers = ANTHROPIC_HEADERS if anthropic else {}
        streamed = reply.route in STREAMED
        last = 0
        ending: str | None = "killed"  # unless it answers before its server is killed
        async with (
            self.killed_or(base, "start"),
            self.http.post(base + path, json=body, headers=headers) as response,
        ):
            if not streamed or response.status != 200:
                parsed = await self.check_status(reply, f"start {reply.route}", response, anthropic)
                if parsed is None:
                    return
                reply.reply_id = response.headers.get("X-Reply-Id")
                got_id.set()
                self.check_whole(reply, parsed)
                return
            reply.reply_id = response.headers.get("X-Reply-Id")
            got_id.set()
            self.run.counts[f"start {reply.route} 200"] += 1
            last, ending = await self.read_stream(
                reply, response, 0, stop_after, f"start {reply.route}"
            )
            if ending is None and not self.resumable(reply):
                reply.cancel_asked = True  # its reader leaves: it stops (none may come back)
        if base in self.run.dead and reply.reply_id is None:
            return  # killed before it answered
        if ending in (None, "killed") and self.resumable(reply):
            # Cut by its reader, or by its server's death: read on, on a server alive.
            await self.pause(reply, rng)
            await self.resume_chain(reply, rng, last, rng.randint(0, 3))

    async def start_narrow(
        self,
        reply: Reply,
        base: str,
        path: str,
        body: dict[str, Any],
        rng: random.Random,
        got_id: asyncio.Event,
    ) -> None:
        """Start a streamed reply read on a narrow connection (``read_narrow``); cut there
        as a slow client, a reply that may be resumed goes on: a resume finds it whole."""
        last, ending = await self.read_narrow(reply, base, path, body, got_id)
        if ending in (None, "killed", "error:slow_client") and self.resumable(reply):
            await self.pause(reply, rng)
            await self.resume_chain(reply, rng, last, rng.randint(0, 1))

    async def read_narrow(
        self, reply: Reply, base: str, path: str, body: dict[str, Any], got_id: asyncio.Event
    ) -> tuple[int, str | None]:
        """POST the reply on a narrow connection whose reader soon stops keeping up
        (``narrow_chunks``), so that the server cuts it as a slow client: then it must be
        told so in its dialect (``slow_client``), and its body end there, cleanly. Or the
        reply's end was queued before the cut: then it has the whole reply. The last id
        read and how the stream ended."""
        what = f"narrow {reply.route}"
        headers = dict(ANTHROPIC_HEADERS) if reply.dialect == "messages" else {}
        host, port = urlsplit(base).hostname or "", urlsplit(base).port or 0
        last, ending = 0, None
        try:
            response = await NarrowResponse.request(
                host, port, "POST", path, json.dumps(body).encode(), headers
            )
        except ConnectionError:
            if base not in self.run.dead:
                raise
            return 0, "killed"
        try:
            if response.status != 200:
                self.run.fail(reply, f"{what}: {response.status}")
                return 0, "bad"
            reply.reply_id = response.headers.get("x-reply-id")
            got_id.set()
            self.run.counts[f"start {reply.route} narrow 200"] += 1
            chunks = self.narrow_chunks(reply, response)
            try:
                last, ending = await self.read_events(
                    reply, chunks, base, 0, None, what, narrow=True
                )
            except ConnectionError as exc:  # not its server killed (``unless_killed``)
                self.run.fail(reply, f"{what}: the body {exc}")
                return last, "bad"
            finally:
                await chunks.aclose()
            self.run.counts[f"{what} {reply.narrow} ending {ending}"] += 1
            if ending not in (None, "killed", "eof", "bad"):
                try:
                    rest = b""
                    while data := await response.read():
                        rest += data
                except ConnectionError as exc:
                    if base not in self.run.dead:
                        self.run.fail(reply, f"{what}: after {ending}, the body {exc}")
                else:
                    if rest.strip():
                        self.run.fail(reply, f"{what}: after {ending}: {rest[:300]!r}")
        finally:
            await response.close()
        return last, ending

    async def narrow_chunks(
        self, reply: Reply, response: NarrowResponse
    ) -> AsyncGenerator[bytes, None]:
        """A narrow reader's body: read at once up to a point early in the reply, then for
        ``NARROW_S`` read not at all (``stall``) or a few bytes at a time (``trickle``),
        then at once to its end."""
        rng = random.Random(f"{self.run.seed}:{reply.seed}:narrow")
        loop = asyncio.get_running_loop()
        keeps_up = rng.randint(0, 600)  # bytes read before it stops keeping up
        while keeps_up > 0:
            data = await response.read(keeps_up)
            if not data:
                return
            keeps_up -= len(data)
            yield data
        until = loop.time() + NARROW_S
        while (left := until - loop.time()) > 0:
            if reply.narrow == "stall":
                await asyncio.sleep(left)
                continue
            data = await response.read(64)
            if not data:
                return
            yield data
            await asyncio.sleep(0.02)
        response.widen()
        while data := await response.read():
            yield data

    async def pause(self, reply: Reply, rng: random.Random) -> None:
        """A short pause before a resume, or now and then one about the detach grace long."""
        if rng.random() < 0.08:
            reply.left_alone = True
            await asyncio.sleep(rng.uniform(0.8, 1.3))
        else:
            await asyncio.sleep(rng.choice([0, 0, rng.uniform(0, 0.05)]))

    def resumable(self, reply: Reply) -> bool:
        return reply.resumable or reply.route in ("responses_bg_stream", "responses_bg")

    def check_whole(self, reply: Reply, body: dict[str, Any]) -> None:
        route = reply.route
        if route == "native_whole":
            told = [(0, body["text"], body["finish_reason"], body.get("stop_sequence"))]
        elif route == "chat_whole":
            told = [
                (c["index"], c["message"]["content"], c["finish_reason"], None)
                for c in body["choices"]
            ]
            if sorted(c for c, *_ in told) != list(range(reply.n)):
                self.run.fail(reply, f"whole chat choices {[c for c, *_ in told]}")
            for choice in body["choices"]:
                if reply.top_logprobs is not None and choice["message"]["content"]:
                    entries = (choice.get("logprobs") or {}).get("content")
                    problem = logprob_problem(
                        choice["message"]["content"], entries, reply.top_logprobs
                    )
                    if problem:
                        self.run.fail(reply, f"whole chat: {problem}")
        else:
            status = body["status"]
            if route == "responses_bg":
                if status not in ("queued", "in_progress"):
                    self.run.fail(reply, f"background POST status {status}")
                return
            if status not in ("completed", "incomplete"):
                if not (status == "cancelled" and reply.cancel_asked):
                    self.run.fail(reply, f"whole response status {status}: {body.get('error')}")
                told = [(0, response_text(body), None, None)]
            else:
                finish = response_finish(body)[0][1]
                told = [(0, response_text(body), finish, None)]
        expect = reply.expect
        for choice, text, finish, stop in told:
            finish = {"content_filter": "moderated"}.get(finish, finish)
            if finish is not None and (text, finish) != (expect.whole, expect.finish):
                self.run.fail(reply, f"whole {choice}: {finish} with {text!r}, expected {expect}")
            elif not expect.whole.startswith(text):
                self.run.fail(reply, f"whole text {text!r} not a beginning of {expect.whole!r}")
            if stop is not None and stop != expect.stop:
                self.run.fail(reply, f"whole {choice}: stopped at {stop!r}, expected {expect}")

    # --- resumes --------------------------------------------------------------------------

    async def resume_chain(self, reply: Reply, rng: random.Random, last: int, cuts: int) -> None:
        """Resume after ``last``, cut again ``cuts`` times, then read to the end (on another
        server when one is killed under a resume)."""
        cut = 0
        while cut <= cuts:
            stop_after = rng.randint(1, 10) if cut < cuts else None
            result = await self.bounded(
                reply, "resume", self.resume_once(reply, rng, last, stop_after)
            )
            if result is None:
                return
            last, ending, status = result
            if ending == "killed":
                continue
            if ending is not None or status != 200:
                return
            cut += 1
            await self.pause(reply, rng)

    async def resume_once(
        self, reply: Reply, rng: random.Random, after: int, stop_after: int | None
    ) -> tuple[int, str | None, int]:
        base = self.url(rng)
        headers: dict[str, str] = {}
        if reply.dialect == "responses" and rng.random() < 0.6:
            url = f"{base}/v1/responses/{reply.response_id}"
            params = {"stream": "true"}
            if after:
                params["starting_after"] = str(after - 1)  # a sequence number: the id less one
            what = "resume responses"
        else:
            url = f"{base}/v1/replies/{reply.reply_id}/stream"
            params = {}
            if after or rng.random() < 0.5:
                headers["Last-Event-ID"] = str(after)
            what = f"resume {reply.dialect}"
        async with (
            self.killed_or(base, what),
            self.http.get(url, params=params, headers=headers) as response,
        ):
            if response.status != 200:
                await self.check_status(
                    reply, what, response, reply.dialect == "messages" and "replies" not in url
                )
                reply.refused.append(f"{what} {response.status} on {base}")
                return after, None, response.status
            self.run.counts[f"{what} 200"] += 1
            last, ending = await self.read_stream(reply, response, after, stop_after, what)
            return last, ending, 200
        return after, "killed", 0  # its server was killed before it answered

    async def join(self, reply: Reply, after: int) -> None:
        url = f"{reply.base}/v1/replies/{reply.reply_id}/stream"
        headers = {"Last-Event-ID": str(after)}
        async with self.http.get(url, headers=headers) as response:
            if response.status != 200:
                await self.check_status(reply, "join", response, False)
                return
            self.run.counts["join 200"] += 1
            await self.read_stream(reply, response, after, None, "join", joined=True)

    # --- side actions ---------------------------------------------------------------------

    async def side_action(self, reply: Reply, rng: random.Random, got_id: asyncio.Event) -> None:
        await got_id.wait()
        await asyncio.sleep(rng.choice([0, rng.uniform(0, 0.02), rng.uniform(0, 0.25)]))
        if reply.reply_id is None:
            return
        choices = ["cancel_native", "reader"]
        if reply.dialect == "responses":
            choices += ["cancel_responses", "delete", "poll", "poll", "reader"]
        action = rng.choice(choices)
        self.run.counts[f"side {action}"] += 1
        if action == "reader":
            known = sorted(reply.texts)
            after = rng.choice([0, *known]) if known else 0
            if self.resumable(reply):
                await self.resume_chain(reply, rng, after, rng.randint(0, 2))
            elif reply.route in STREAMED and reply.base:
                # A reply nobody may resume, joined on its own server while it runs: what its
                # reader has sent is gone (a gap, or a dialect's events_lost), the rest follows.
                await self.bounded(reply, "join", self.join(reply, after))
        elif action == "poll":
            await self.bounded(reply, "poll", self.poll(reply, rng))
        else:
            await self.bounded(reply, action, self.stop(reply, rng, action))

    async def stop(self, reply: Reply, rng: random.Random, action: str) -> None:
        base = self.url(rng)
        if action == "delete":
            call = self.http.delete(f"{base}/v1/responses/{reply.response_id}")
        elif action == "cancel_responses":
            call = self.http.post(f"{base}/v1/responses/{reply.response_id}/cancel")
        else:
            call = self.http.post(f"{base}/v1/replies/{reply.reply_id}/cancel")
        reply.cancel_asked = True
        if action == "delete":
            reply.deleted = True
        body = None
        async with self.killed_or(base, action), call as response:
            body = await self.check_status(reply, action, response, False)
            if not reply.stored and action != "cancel_native" and response.status != 404:
                self.run.fail(reply, f"{action} of a response not stored: {response.status}")
        if body is not None and action == "cancel_responses":
            status = body.get("status")
            if status not in ("cancelled", "completed", "incomplete", "failed"):
                self.run.fail(reply, f"cancel answered status {status}")
            self.check_object(reply, body, "cancel")

    async def poll(self, reply: Reply, rng: random.Random) -> str | None:
        base = self.url(rng)
        body = None
        call = self.http.get(f"{base}/v1/responses/{reply.response_id}")
        async with self.killed_or(base, "poll"), call as response:
            body = await self.check_status(reply, "poll", response, False)
            if not reply.stored and response.status != 404:
                self.run.fail(reply, f"poll of a response not stored: {response.status}")
            if body is None:
                reply.refused.append(f"poll {response.status} on {base}")
        if body is None:
            return "gone" if base in self.run.dead else None
        self.check_object(reply, body, "poll")
        self.run.counts[f"poll status {body['status']}"] += 1
        if body["status"] not in ("queued", "in_progress"):
            reply.ends_told += 1
        return str(body["status"])

    @contextlib.asynccontextmanager
    async def killed_or(self, base: str, what: str) -> AsyncIterator[None]:
        """A call whose server was killed under it fails on the wire, as it must."""
        try:
            yield
        except (aiohttp.ClientError, ConnectionError) as exc:
            if base not in self.run.dead:
                raise
            self.run.counts[
                f"transport error {what} on the killed server: {type(exc).__name__}"
            ] += 1

    def check_object(self, reply: Reply, body: dict[str, Any], what: str) -> None:
        status = body["status"]
        text = response_text(body)
        expect = reply.expect
        if status in ("completed", "incomplete"):
            finish = response_finish(body)[0][1]
            if finish != expect.finish or not told_whole(expect, text):
                self.run.fail(reply, f"{what}: {status} ({finish}) with {text!r}: {expect}")
        elif not expect.most.startswith(text):
            self.run.fail(reply, f"{what}: {status} text {text!r} not a beginning")
        if status == "failed" and not (reply.base in self.run.dead and lost(body.get("error"))):
            self.run.fail(reply, f"{what}: failed {body.get('error')}")

    async def poll_until_ended(self, reply: Reply, rng: random.Random) -> None:
        """Poll a stored response until it ends (or is gone); it must end within bounds."""
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            status = await self.bounded(reply, "poll", self.poll(reply, rng))
            if status is None or status not in ("queued", "in_progress"):
                return
            await asyncio.sleep(0.05)
        self.run.fail(reply, "stored response still running after {HANG_S} s")

    # --- WebSocket ------------------------------------------------------------------------

    async def ws_episode(self, reply: Reply, rng: random.Random) -> None:
        base = reply.base = self.url(rng)
        message: dict[str, Any] = {
            "type": "reply",
            "id": "a",
            "prompt": "x",
            "max_tokens": reply.max_tokens,
        }
        if reply.resumable:
            message["resumable"] = True
        if reply.stops:
            message["stop"] = list(reply.stops)
        extra = self.delivery(rng)
        reply.window = extra.get("holdback_tokens", 0)
        message.update(extra)
        reply.body = json.dumps(message)
        if reply.narrow:
            read = self.ws_read_narrow(reply, base, message)
        else:
            read = self.ws_read(reply, rng, base, message)
        result = await self.bounded(reply, "ws", read)
        if result is None:
            return
        last, ended = result
        if not ended and reply.resumable and reply.reply_id:
            await self.pause(reply, rng)
            await self.resume_chain(reply, rng, last, rng.randint(0, 2))

    async def ws_read(
        self, reply: Reply, rng: random.Random, base: str, message: dict[str, Any]
    ) -> tuple[int, bool]:
        stop_after = rng.choice([None, rng.randint(0, 12)])
        cancel_after = rng.choice([None, None, rng.randint(0, 12)])
        last = 0
        seen = 0
        async with self.killed_or(base, "ws"), self.http.ws_connect(base + "/v1/ws") as ws:
            await ws.send_json(message)
            async for frame in ws:
                if frame.type != aiohttp.WSMsgType.TEXT:
                    if base in self.run.dead:
                        break
                    self.run.fail(reply, f"ws frame {frame.type}")
                    return last, True
                data = json.loads(frame.data)
                if "seq" not in data:
                    if (
                        data["type"] == "error"
                        and data["data"]["error"]["code"] == "reply_not_found"
                    ):
                        self.run.counts["ws cancel of an ended reply"] += 1
                        continue
                    self.run.fail(reply, f"ws message without seq: {data}")
                    return last, True
                last, ended = self.ws_message(reply, data, last)
                if ended:
                    return last, True
                seen += 1
                if cancel_after is not None and seen == cancel_after:
                    reply.cancel_asked = True
                    await ws.send_json({"type": "cancel", "id": "a"})
                if stop_after is not None and seen >= stop_after:
                    reply.cancel_asked |= not reply.resumable  # its socket closes: it stops
                    return last, False
        return last, False

    def ws_message(self, reply: Reply, data: dict[str, Any], last: int) -> tuple[int, bool]:
        """Take one of the reply's messages (one with a ``seq``); whether it ends the reply."""
        kind = data["type"]
        reply.reply_id = data["reply_id"]
        seq = data["seq"]
        if seq != last + 1:
            self.run.fail(reply, f"ws seq {seq} after {last}")
        text = pieces("native", kind, data["data"])
        known = reply.texts.setdefault(seq, text)
        if known != text:
            self.run.fail(reply, f"ws: seq {seq} text {text!r}, another saw {known!r}")
        reply.finishes.update(finishes("native", kind, data["data"]))
        if kind not in ("done", "error", "moderated"):
            return seq, False
        reply.final_ids.add(seq)
        reply.ends_told += 1
        ending = "complete"
        if kind == "error":
            ending = f"error:{data['data']['error']['code']}"
        if ending == "complete":
            reply.complete_told += 1
        elif not reply.cancel_asked:
            reply.odd_endings.append(f"ws: {ending}")
        self.run.counts[f"ending ws {ending}"] += 1
        return seq, True

    async def ws_read_narrow(
        self, reply: Reply, base: str, message: dict[str, Any]
    ) -> tuple[int, bool]:
        """A WebSocket on a narrow connection that reads nothing (or a frame at a time,
        slowly) for ``NARROW_S`` after its first frames: the server cuts it as a slow
        client, and then it must get the reply's ``error`` (``slow_client``), a close frame
        (1008, ``slow_client``), and the end of the connection. Or the whole reply."""
        rng = random.Random(f"{self.run.seed}:{reply.seed}:narrow")
        parts = urlsplit(base)
        try:
            ws = await RawWebSocket.connect(parts.hostname or "", parts.port or 0, "/v1/ws")
        except ConnectionError:
            if base not in self.run.dead:
                raise
            return 0, False
        last, ended, told = 0, False, ""
        loop = asyncio.get_running_loop()
        keeps_up = rng.randint(0, 3)  # frames read before it stops keeping up
        until: float | None = None
        widened = False
        try:
            ws.send_json(message)
            while True:
                if until is None and keeps_up <= 0:
                    until = loop.time() + NARROW_S
                    if reply.narrow == "stall":
                        await asyncio.sleep(NARROW_S)
                elif until is not None and loop.time() < until:
                    await asyncio.sleep(0.05)  # a frame at a time
                elif until is not None and not widened:
                    ws.widen()  # from now on at full speed
                    widened = True
                keeps_up -= 1
                opcode, payload = await ws.receive()
                if opcode == 1:
                    data = json.loads(payload)
                    if "seq" in data:
                        if ended or told:
                            self.run.fail(reply, f"narrow ws: {data} after {told or 'the end'}")
                        last, ended = self.ws_message(reply, data, last)
                    elif data["type"] == "error" and not told:
                        told = data["data"]["error"]["code"]
                        self.run.counts[f"narrow ws {reply.narrow} told {told}"] += 1
                        if told != "slow_client":
                            self.run.fail(reply, f"narrow ws: {data}")
                    else:
                        self.run.fail(reply, f"narrow ws: {data} after {told}")
                elif opcode == 8:
                    code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else None
                    self.run.counts[f"narrow ws {reply.narrow} closed {code}"] += 1
                    if not told or (code, payload[2:]) != (1008, b"slow_client"):
                        self.run.fail(reply, f"narrow ws: closed {code} {payload[2:]!r}")
                    if (await ws.receive())[0] != -1:
                        self.run.fail(reply, "narrow ws: a frame after the close")
                    return last, ended
                elif opcode == -1:
                    if base not in self.run.dead:
                        self.run.fail(reply, f"narrow ws: the end, not closed, after {last}")
                    return last, ended
                elif opcode not in (9, 10):
                    self.run.fail(reply, f"narrow ws: frame {opcode}")
                if ended and not told:
                    self.run.counts[f"narrow ws {reply.narrow} whole"] += 1
                    return last, True  # whole before any cut: it leaves
        except ConnectionError as exc:
            if base not in self.run.dead:
                self.run.fail(reply, f"narrow ws: {exc} after {last} ({told})")
            return last, ended
        finally:
            await ws.close()

    # --- after ----------------------------------------------------------------------------

    def lost(self, reply: Reply) -> bool:
        """A reply of a killed server that a server alive can still tell of: resumable, or
        a stored response."""
        return (
            reply.base in self.run.dead
            and reply.reply_id is not None
            and not reply.deleted
            and (self.resumable(reply) or (reply.dialect == "responses" and reply.stored))
        )

    async def read_lost(self, reply: Reply) -> None:
        """On a server alive, after the run: read it to its end if none of its readers was
        told it, and poll a stored response until it ends. Its producer gone, it must end
        ``generator_lost`` (a response ``failed`` saying so) if it had not ended before."""
        rng = random.Random(f"{self.run.seed}:{reply.seed}:lost")
        if self.resumable(reply) and not reply.ends_told:
            self.run.counts[f"lost {reply.route} resumed after"] += 1
            await self.resume_chain(reply, rng, max(reply.texts, default=0), 0)
        if reply.dialect == "responses" and reply.stored:
            self.run.counts[f"lost {reply.route} polled after"] += 1
            await self.poll_until_ended(reply, rng)

    def check_reply(self, reply: Reply) -> None:
        """Each choice's text in id order is a beginning of what the request makes; whole if
        told it ended, and finished as the request makes it finish."""
        expect = reply.expect
        for choice, finish, stop in sorted(reply.finishes, key=str):
            # Chat and Responses do not name the stop string (OpenAI's do not).
            named = expect.stop if reply.dialect in ("native", "messages") else None
            if choice not in range(reply.n) or finish != expect.finish or stop != named:
                self.run.fail(reply, f"choice {choice} told {finish} {stop!r}: {expect}")
        if not reply.texts:
            return
        ids = sorted(reply.texts)
        joined = [""] * reply.n
        holes = False
        for count, event_id in enumerate(ids, start=1):
            if event_id != count:
                holes = True
                break
            for choice, text in reply.texts[event_id]:
                if choice not in range(reply.n):
                    self.run.fail(reply, f"text of choice {choice}")
                    return
                joined[choice] += text
        for choice, text in enumerate(joined):
            if not expect.most.startswith(text):
                self.run.fail(reply, f"choice {choice} text {text!r} not a beginning: {expect}")
            if reply.complete_told and not holes and not told_whole(expect, text):
                self.run.fail(reply, f"choice {choice} told complete with {text!r}: {expect}")
        if reply.odd_endings and not reply.left_alone:
            self.run.fail(reply, f"ended oddly with nobody stopping it: {reply.odd_endings}")
        if self.lost(reply) and not reply.ends_told:
            seen = max(reply.texts, default=0)
            refused = reply.refused
            if reply.dialect == "responses" and refused and all(" 404 " in r for r in refused):
                # Killed after its reader had its first events, before they were logged:
                # another replica finds the response's record but no event, and answers
                # 404 (a known gap: its producer logs events a moment after it sends them).
                self.run.counts["lost responses never logged: 404 elsewhere"] += 1
            else:
                told = f"its end never told (saw {seen}): {refused}"
                self.run.fail(reply, f"its server killed, {told}")
        if len(reply.final_ids) > 1:
            self.run.fail(reply, f"several terminal events: {sorted(reply.final_ids)}")


def told_whole(expect: Expected, text: str) -> bool:
    """A text told whole: exactly the whole reply's, but for the start of a banned phrase a
    window shorter than it let out."""
    return text.startswith(expect.whole) and expect.most_told.startswith(text)


def lost(error: Any) -> bool:
    """A response's error saying its producer is gone."""
    return isinstance(error, dict) and str(error.get("message", "")).endswith("(generator_lost)")


def response_text(body: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in body.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
    )


def draw_options(reply: Reply, rng: random.Random) -> None:
    """Now and then stop strings (pieces of the engine's text, one word or across words),
    several choices, log probabilities."""
    if rng.random() < 0.25:
        text = reference(MAX_TOKENS)
        starts = [0, *(at + 1 for at, char in enumerate(text) if char == " ")][:-1]
        stops = []
        for _ in range(rng.randint(1, 2)):
            # From near a word's start, as likely in a long word as in any other.
            at = rng.choice(starts)
            at += rng.randrange(min(text.index(" ", at) - at + 1, 8))
            stop = text[at : at + rng.randint(1, 10)]
            if stop.strip():
                stops.append(stop)
        if not overlaps_ban(reply.max_tokens, tuple(stops)):
            reply.stops = tuple(stops)
    if reply.route.startswith("chat") and rng.random() < 0.3:
        reply.n = rng.randint(2, 3)
    if reply.dialect in ("chat", "responses") and rng.random() < 0.25:
        reply.top_logprobs = rng.randint(0, 3)


async def client(driver: Driver, n: int, episodes: int) -> None:
    rng = random.Random(f"{driver.run.seed}:{n}")
    for e in range(episodes):
        route = rng.choice(ROUTES)
        resumable = route in ("native", "chat", "messages", "ws") and rng.random() < 0.7
        reply = Reply(f"{n}.{e}", route, rng.randint(1, MAX_TOKENS), resumable)
        draw_options(reply, rng)
        if route in (*STREAMED, "ws") and rng.random() < NARROW_SHARE:
            # Its reader stops keeping up early: a reply with both long words, more than a
            # narrow link holds, is cut for it.
            reply.narrow = rng.choice(["stall", "trickle"])
            reply.max_tokens = rng.randint(max(LONG_WORDS) + 1, MAX_TOKENS)
        await driver.episode(reply, rng)
        await asyncio.sleep(rng.uniform(0, 0.05))


GAUGES = (
    "replystream_active_streams",
    "replystream_replies_in_flight",
    "replystream_open_readers",
    "replystream_engine_requests",
    "replystream_open_tasks",
)


async def gauges(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES or name.startswith("replystream_reply_logs"):
            found[name] = float(value)
    return found


@dataclass(frozen=True)
class Kill:
    """A server to kill (SIGKILL: no goodbye to Redis or to its clients) during the run,
    ``after_s`` after it begins; the driver then uses the others alone."""

    url: str
    after_s: float
    kill: Callable[[], None]


async def run(
    seed: int, urls: list[str], clients: int, episodes: int, kill: Kill | None = None
) -> Run:
    """Drive ``clients`` clients of ``episodes`` replies each; return the run's record.

    With ``kill``, a reply its server produced when it died may end ``generator_lost`` (on
    the Responses API, ``error`` then ``response.failed`` saying so), or its readers there
    be cut; anything else is held to the same rules: every other reply, its readers
    elsewhere, and every reply started after, are whole."""
    result = Run(seed, urls)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        await warm_up(http, urls)
        baseline = {url: await gauges(http, url) for url in urls}
        driver = Driver(result, http)
        began = time.monotonic()
        async with asyncio.TaskGroup() as group:
            for n in range(clients):
                group.create_task(client(driver, n, episodes))
            if kill is not None:
                group.create_task(kill_later(result, kill))
        result.counts["wall ms"] = int((time.monotonic() - began) * 1000)
        async with asyncio.TaskGroup() as group:
            for reply in result.replies:
                if driver.lost(reply):
                    group.create_task(driver.read_lost(reply))
        for reply in result.replies:
            driver.check_reply(reply)
        live = {url: values for url, values in baseline.items() if url not in result.dead}
        await back_to_baseline(result, http, live)
    return result


async def kill_later(result: Run, kill: Kill) -> None:
    await asyncio.sleep(kill.after_s)
    result.dead.add(kill.url)
    kill.kill()


async def warm_up(http: aiohttp.ClientSession, urls: list[str]) -> None:
    """One resumable reply on each server, resumed on the next: what a server starts once,
    at its first such reply (a store's flusher and heartbeat), is in the baseline."""
    for n, url in enumerate(urls):
        body = {"prompt": "x", "max_tokens": 2, "resumable": True}
        async with http.post(url + "/v1/replies", json=body) as response:
            await response.read()
            reply_id = response.headers["X-Reply-Id"]
        resume = f"{urls[(n + 1) % len(urls)]}/v1/replies/{reply_id}/stream"
        async with http.get(resume, headers={"Last-Event-ID": "1"}) as response:
            await response.read()
    await asyncio.sleep(0.5)


async def back_to_baseline(
    result: Run, http: aiohttp.ClientSession, baseline: dict[str, dict[str, float]]
) -> None:
    deadline = time.monotonic() + 20
    while True:
        now = {url: await gauges(http, url) for url in baseline}
        off = {
            url: {
                name: (baseline[url].get(name), value)
                for name, value in values.items()
                if name in GAUGES and value != baseline[url].get(name)
            }
            for url, values in now.items()
        }
        if not any(off.values()):
            return
        if time.monotonic() > deadline:
            result.fail(None, f"gauges not back to baseline 20 s after: {off}")
            return
        await asyncio.sleep(0.2)


def log_problems(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if "ERROR" in line or "Traceback" in line or "exception" in line.lower()
    ]
