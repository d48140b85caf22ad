"""``ServerConfig``: the server-wide settings a server is started with.

Apart from the server's request context (``server.context``, which needs aiohttp and the
delivery path) so that ``serve``'s settings, which fill it from the command line, are read
without the server: a wrong flag is told before the app loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replystream.delivery.policy import DeliveryPolicy
from replystream.server.guard_config import GuardConfig


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Server-wide settings; the delivery policy holds the per-request defaults."""

    policy: DeliveryPolicy = field(default_factory=DeliveryPolicy)
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 100_000
    shutdown_grace_s: float = 10.0
    gzip_min_bytes: int = 512
    resumable_by_default: bool = False
    detach_grace_s: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no auth
    model_name: str | None = None  # the model the OpenAI routes serve (None: the engine's name)
    ws_max_replies: int = 8  # replies one WebSocket may run at once
    guard: GuardConfig = field(default_factory=GuardConfig)  # per-client limits, CORS, timeouts
    max_header_bytes: int = 8190  # one request line or header field at most
