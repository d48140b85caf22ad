"""A client on a network of its own: a Linux network namespace joined to this one by a veth
pair, whose packets can all be dropped (a phone gone into a tunnel: no FIN, no reset). A
server the code under test depends on (Redis, an upstream) may run there too
(``Namespace.inside``), listening on ``Namespace.client_ip``, to go dark the same way.

The server under test listens on this side's address of the pair (``Namespace.server_ip``).
A client runs inside the namespace on an event loop of its own (``Namespace.run``: a thread
that joins the namespace, since a network namespace is a thread's), so any client code works
there unchanged; ``Namespace.socket`` makes one socket there for this loop's use.
``blackout`` drops every packet in and out of the namespace with nftables, ``restore`` lets
them pass again. Needs root, ``ip`` (iproute2) and ``nft`` (nftables): without them a test
is skipped with the reason, unless ``REPLYSTREAM_REQUIRE_SERVICES=1``, where it fails. The
namespace and its link are removed on exit, whatever the test did.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import itertools
import os
import socket
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import NoReturn, TypeVar

import pytest

from tests.services import REQUIRE_ENV, require_binary, services_required

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
_made = itertools.count()
# One /30 per pair out of the shared address space (RFC 6598), chosen from the process id so
# that test workers running at once never take the same one.
_SPACE = ipaddress.ip_network("100.64.0.0/10")

_BLACKOUT = """
table inet blackout {
  chain incoming { type filter hook input priority -300; policy drop; }
  chain outgoing { type filter hook output priority -300; policy drop; }
}
"""

# The same for the TCP ports of one server in the namespace (its address's, whoever the peer).
_BLACKOUT_PORTS = """
table inet blackout {{
  chain incoming {{
    type filter hook input priority -300;
    ip daddr {ip} tcp dport {{ {ports} }} drop;
    ip saddr {ip} tcp sport {{ {ports} }} drop;
  }}
  chain outgoing {{
    type filter hook output priority -300;
    ip saddr {ip} tcp sport {{ {ports} }} drop;
    ip daddr {ip} tcp dport {{ {ports} }} drop;
  }}
}}
"""


def _skip_or_fail(reason: str) -> NoReturn:
    if services_required():
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires it")
    pytest.skip(reason)


def require_netns() -> None:
    """Skip the test (or fail it under ``REPLYSTREAM_REQUIRE_SERVICES=1``) unless network
    namespaces can be made here: root, ``ip`` and ``nft``."""
    if os.geteuid() != 0:
        _skip_or_fail(
            "network namespaces need root (the test puts a client on a network of its own)"
        )
    require_binary("ip", "iproute2")
    require_binary("nft", "nftables")


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=10)


class Namespace:
    """A network namespace with one veth link to this one (see the module's docstring)."""

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.host_link = f"{name}h"
        base = _SPACE.network_address + (index * 4) % _SPACE.num_addresses
        self.server_ip = str(base + 1)  # this side
        self.client_ip = str(base + 2)  # the namespace's side
        self._nft = require_binary("nft", "nftables")

    def _up(self) -> None:
        peer = f"{self.name}n"
        self._down()  # one left by a killed process that had the same id
        try:
            _ip("netns", "add", self.name)
        except subprocess.CalledProcessError as exc:  # root in a container without the right
            _skip_or_fail(f"no network namespace can be made here: {exc.stderr.decode().strip()}")
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.name)
        _ip("addr", "add", f"{self.server_ip}/30", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        _ip("-n", self.name, "addr", "add", f"{self.client_ip}/30", "dev", peer)
        _ip("-n", self.name, "link", "set", peer, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")

    def _down(self) -> None:
        # Deleting one end of a pair deletes both; the namespace goes with its last user.
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)

    @property
    def inside(self) -> tuple[str, ...]:
        """The words that run a command inside the namespace (a server that goes dark with
        it), to put before the command's own."""
        return ("ip", "netns", "exec", self.name)

    async def _nft_run(self, *argv: str, stdin: bytes = b"") -> None:
        process = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", self.name, self._nft, *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await process.communicate(stdin)
        assert process.returncode == 0, err.decode()

    async def blackout(self, *ports: int) -> None:
        """Drop every packet in and out of the namespace from now on: its peers hear
        nothing more from it, not even a reset. With ``ports``, only the TCP packets to or
        from those ports of the namespace's own: one server there gone dark, the others not."""
        rules = _BLACKOUT
        if ports:
            listed = ", ".join(str(port) for port in ports)
            rules = _BLACKOUT_PORTS.format(ports=listed, ip=self.client_ip)
        await self._nft_run("-f", "-", stdin=rules.encode())

    async def restore(self) -> None:
        """Let packets pass again (those dropped meanwhile stay lost)."""
        await self._nft_run("delete", "table", "inet", "blackout")

    def _join(self) -> None:
        """Move the calling thread into the namespace (for good: only threads of our own)."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/run/netns/{self.name}") as handle:
            if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns failed")

    async def _in_thread(self, call: Callable[[], T]) -> T:
        """``call()`` on a new thread inside the namespace; the thread ends with it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def body() -> None:
            try:
                self._join()
                result = call()
            except BaseException as exc:
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        threading.Thread(target=body, daemon=True).start()
        return await done

    async def run(self, client: Callable[[], Awaitable[T]]) -> T:
        """Run ``client()`` inside the namespace, on an event loop of its own, and return
        what it returns."""

        def run_loop() -> T:
            async def main() -> T:
                return await client()

            return asyncio.run(main())

        return await self._in_thread(run_loop)

    async def socket(self) -> socket.socket:
        """A non-blocking TCP socket made inside the namespace: it connects, sends and
        receives there, whichever thread uses it afterwards."""

        def make() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            return sock

        return await self._in_thread(make)


PREFIX = "rst"  # then the process id, "x" and a count: at most 15 characters with a suffix


def _sweep() -> None:
    """Remove the namespaces (and links) of test processes that died without their cleanup
    (killed by a timeout): a later run would find their addresses taken."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    for line in listing.stdout.splitlines():
        name = line.split(" ", 1)[0]
        pid = name.removeprefix(PREFIX).partition("x")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            Namespace(name, 0)._down()


@contextlib.contextmanager
def client_namespace() -> Iterator[Namespace]:
    """A fresh namespace and its link, removed on exit."""
    require_netns()
    _sweep()
    count = next(_made)
    index = os.getpid() * 16 + count
    namespace = Namespace(f"{PREFIX}{os.getpid()}x{count % 100}", index)
    try:
        namespace._up()
        yield namespace
    finally:
        namespace._down()
