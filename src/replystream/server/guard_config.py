"""``GuardConfig``: the client limits, CORS origins and trusted proxies a server is started with.

Apart from the guard that applies them (``server.guard``, which needs aiohttp) so that
``serve``'s settings, which fill it from the command line, are read without the server: a
wrong flag is told before the app loads.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """Client limits; 0 turns a limit off. ``trusted_proxies``: peers whose
    ``X-Forwarded-For`` names the client (none by default: the header is ignored)."""

    max_concurrent: int = 0
    per_minute: int = 0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Request-body bytes being read at once, over every connection (``guard.BodyRoom``):
    # 64 bodies of the default 1 MiB still arriving, about 140 MiB held as aiohttp reads them.
    max_reading_bytes: int = 64 * 1024 * 1024
    # A kept-alive connection silent between requests: nginx's keepalive_timeout. Above the
    # idle timeouts of the load balancers most put in front (AWS's 60 s), so the balancer,
    # not the server, closes an idle connection, and never one it is sending a request on.
    idle_timeout_s: float = 75.0
    cors_origins: tuple[str, ...] = ()
    # Names a request reaching a loopback address may give in its Host besides local ones
    # (``browser_guard.rebinding_refusal``); ``*`` takes any.
    allowed_hosts: tuple[str, ...] = ()
    trusted_proxies: tuple[Network, ...] = ()


def parse_trusted_proxies(values: Sequence[str]) -> tuple[Network, ...]:
    """Addresses and CIDR networks, each value one or a comma-separated list.

    Raises:
        ValueError: an entry is neither (the message names ``--trusted-proxy``).
    """
    networks: list[Network] = []
    for value in values:
        for entry in value.split(","):
            entry = entry.strip()
            try:
                network = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"--trusted-proxy wants IP addresses or CIDR networks "
                    f"(e.g. 10.0.0.0/8,127.0.0.1), got {entry!r}"
                ) from None
            networks.append(_as_ipv4(network))
    return tuple(networks)


def _as_ipv4(network: Network) -> Network:
    """An IPv4-mapped network (``::ffff:10.0.0.1``, ``::ffff:10.0.0.0/104``) as the IPv4 one
    it maps: peers and forwarded addresses in that form are compared as IPv4 ones, which the
    mapped form would never match."""
    mapped = network.network_address.ipv4_mapped if network.version == 6 else None
    if mapped is None or network.prefixlen < 96:
        return network
    return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
