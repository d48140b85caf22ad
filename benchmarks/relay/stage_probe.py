"""``replystream serve``, with each relayed request's way to its first text stamped.

Run by ``first_token_stages.py`` as ``python stage_probe.py OUT serve ARGS...``: the server
runs as the CLI runs it, on asyncio's own loop (``--loop asyncio``: the stamps wrap its
transport), with these functions wrapped to stamp the time (``perf_counter``), the loop turn
(a count of ``_run_once``) and, at two of them, the thread's CPU time:

- ``accepted``: the client's connection made (``connection_made`` of the server's protocol);
- ``read``: its request's first bytes handed to it (``data_received``);
- ``handler``: aiohttp starts the request's handler task (``_handle_request``);
- ``sent``: the request written to the upstream (``upstream_http_connection.Connection.send``);
- ``head``: the upstream's first bytes back (that connection's ``data_received``);
- ``resumed``: the handler has the response head (``HttpOrigin.post`` returns);
- ``written``: the first write to the client holding the upstream's text (``MARKER``).

On SIGUSR1 the stamps of every request that reached ``written`` since the last signal are
written to ``OUT.<n>`` (JSON, one object per request, renamed into place once whole) and
forgotten. The wrappers cost a few microseconds per call, on every request alike (and the
loop's turn counter a little per turn). Names of private aiohttp and replystream functions
are wrapped here: if one is gone, this fails at start, loudly.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import signal
import sys
import time
from asyncio import base_events, selector_events
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web_protocol

from replystream import cli
from replystream.engine import upstream_http, upstream_http_connection
from replystream.server import connection as server_connection

if __package__ in (None, ""):  # run as a script: the ``relay`` package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.upstream_server import MARKER

STAGES = ("accepted", "read", "handler", "sent", "head", "resumed", "written")
Stamps = dict[str, float]

_turn = itertools.count()
_turns = [0]
_open: dict[int, Stamps] = {}  # by id() of the client's protocol, until ``written``
_by_upstream: dict[int, Stamps] = {}  # by id() of the upstream connection, until ``head``
_handler_stamps: dict[asyncio.Task[Any], Stamps] = {}  # by the request's handler task
_done: list[Stamps] = []


def _stamp(stamps: Stamps, stage: str, cpu: bool = False) -> None:
    if stage not in stamps:
        stamps[stage] = time.perf_counter()
        stamps["turn " + stage] = _turns[0]
        if cpu:
            stamps["cpu " + stage] = time.thread_time()


def _task_stamps() -> Stamps | None:
    task = asyncio.current_task()
    return None if task is None else _handler_stamps.get(task)


def _wrap(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Any]) -> None:
    original = getattr(owner, name)  # AttributeError at start if a name is gone
    setattr(owner, name, functools.wraps(original)(wrapper(original)))


def _install() -> None:
    def run_once(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any) -> Any:
            _turns[0] = next(_turn)
            return original(self)

        return counted

    _wrap(base_events.BaseEventLoop, "_run_once", run_once)

    def made(original: Callable[..., Any]) -> Callable[..., Any]:
        def stamped(self: Any, transport: Any) -> Any:
            stamps = _open[id(self)] = {}
            _stamp(stamps, "accepted")
            return original(self, transport)

        return stamped

    def on_data(
        table: dict[int, Stamps], stage: str, *, forget: bool
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A protocol's ``data_received`` stamping ``stage`` for the request it is in
        ``table`` for (and, with ``forget``, no more)."""

        def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            def stamped(self: Any, data: bytes) -> Any:
                stamps = table.pop(id(self), None) if forget else table.get(id(self))
                if stamps is not None:
                    _stamp(stamps, stage)
                return original(self, data)

            return stamped

        return wrapper

    _wrap(server_connection.Connection, "connection_made", made)
    _wrap(server_connection.Connection, "data_received", on_data(_open, "read", forget=False))

    def handled(
        original: Callable[..., Coroutine[Any, Any, Any]],
    ) -> Callable[..., Coroutine[Any, Any, Any]]:
        async def stamped(self: Any, *args: Any) -> Any:
            stamps = _open.get(id(self))
            task = asyncio.current_task()
            if stamps is not None and task is not None:
                _stamp(stamps, "handler", cpu=True)
                _handler_stamps[task] = stamps
            try:
                return await original(self, *args)
            finally:
                if task is not None:
                    _handler_stamps.pop(task, None)

        return stamped

    _wrap(web_protocol.RequestHandler, "_handle_request", handled)

    def send(original: Callable[..., Any]) -> Callable[..., Any]:
        def stamped(self: Any, request: bytes) -> Any:
            stamps = _task_stamps()
            if stamps is not None:
                _stamp(stamps, "sent", cpu=True)
                _by_upstream[id(self)] = stamps
            return original(self, request)

        return stamped

    _wrap(upstream_http_connection.Connection, "send", send)
    _wrap(
        upstream_http_connection.Connection,
        "data_received",
        on_data(_by_upstream, "head", forget=True),
    )

    def post(
        original: Callable[..., Coroutine[Any, Any, Any]],
    ) -> Callable[..., Coroutine[Any, Any, Any]]:
        async def stamped(*args: Any) -> Any:
            response = await original(*args)
            stamps = _task_stamps()
            if stamps is not None:
                _stamp(stamps, "resumed")
            return response

        return stamped

    _wrap(upstream_http.HttpOrigin, "post", post)

    def write(original: Callable[..., Any]) -> Callable[..., Any]:
        def stamped(self: Any, data: Any) -> Any:
            key = id(self._protocol)
            if key in _open and MARKER in data:
                stamps = _open.pop(key)
                _stamp(stamps, "written")
                if all(stage in stamps for stage in STAGES):
                    _done.append(stamps)
            return original(self, data)

        return stamped

    transport = selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
    _wrap(transport, "write", write)


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    if "--loop" not in argv:
        argv += ["--loop", "asyncio"]
    _install()
    batches = itertools.count(1)

    def dump(*_: object) -> None:
        rows, _done[:] = list(_done), []
        written = out.with_suffix(".writing")
        written.write_text(json.dumps(rows))
        written.rename(out.with_suffix(f".{next(batches)}"))  # whole when it appears

    signal.signal(signal.SIGUSR1, dump)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
