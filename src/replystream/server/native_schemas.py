"""The declared shape of the native API's requests: ``POST /v1/replies`` and the WebSocket's
messages (``reply``, which takes the same fields, ``cancel`` and ``auth``).

This file decides what they accept, field by field, and the checks within one body (exactly
one of ``prompt`` and ``messages``; ``disconnect`` only on a stream, ``detach`` only on a
reply that may be resumed). Turning a body into a request is ``server.native``'s; reading a
WebSocket message, tag first, is ``server.socket_messages``'s. It must not know about
aiohttp or engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from replystream.server.chat_message_schemas import Messages
from replystream.server.schema_fields import (
    ClientTag,
    SamplingFields,
    Strict,
    TokenCount,
    invalid,
)


class ReplyBody(SamplingFields):
    """``POST /v1/replies``: exactly one of ``prompt`` and ``messages``."""

    prompt: str | None = None
    messages: Messages | None = None
    # The model to route by, as chat's: one of a relay's models or aliases (none: the
    # server's default model).
    model: str | None = None
    max_tokens: TokenCount | None = None
    stream: bool = True
    disconnect: Literal["cancel", "detach"] | None = None

    @model_validator(mode="after")
    def _disconnect_is_for_streams(self) -> ReplyBody:
        if self.disconnect is not None and not self.stream:
            message = "disconnect applies to streamed replies (stream: true)"
            raise invalid(message, "disconnect")
        return self

    @model_validator(mode="after")
    def _detached_replies_are_resumable(self) -> ReplyBody:
        # A detached reply goes on for its client to come back to: one nobody may resume
        # would be generated for nobody (and its log dropped once it ended unread).
        if self.disconnect == "detach" and self.resumable is False:
            message = (
                'disconnect "detach" keeps the reply for its client to resume, which '
                "resumable: false forbids; drop one of them"
            )
            raise invalid(message, "disconnect")
        return self

    @property
    def resumable_asked(self) -> bool | None:
        """Whether the reply is resumable (None: the server's default): ``detach`` makes it
        so, as ``resumable`` makes ``detach`` the default disconnect policy."""
        if self.resumable is None and self.disconnect == "detach":
            return True
        return self.resumable

    @model_validator(mode="before")
    @classmethod
    def _one_prompt(cls, data: Any) -> Any:
        # Before the fields: with both given, which one is bad is beside the point.
        if isinstance(data, dict) and ("prompt" in data) == ("messages" in data):
            raise invalid("give exactly one of prompt or messages", "prompt")
        return data


class SocketEnvelope(Strict):
    """What a WebSocket message says of itself: its ``type`` and the client's tag ``id``
    (every message but ``auth`` has one). Read first (other fields ignored), so an error
    about the rest can name the tag."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    id: ClientTag | None = None
    type: Any = None


class ReplyMessage(ReplyBody):
    """``{"type": "reply", "id": <tag>, ...}``: the fields of ``POST /v1/replies``."""

    type: Literal["reply"]
    id: ClientTag

    @model_validator(mode="after")
    def _streamed(self) -> ReplyMessage:
        if not self.stream:
            raise invalid("replies over a WebSocket are streamed", "stream")
        if self.keepalive_s is not None:
            # The socket, not each reply, is kept alive: pinged while idle at the server's
            # --keepalive-s. A reply's own interval would be taken and never applied.
            raise PydanticCustomError(
                "not_honoured",
                "not taken on a WebSocket: the server pings an idle socket "
                "every --keepalive-s, whatever its replies ask",
                {"param": "keepalive_s"},
            )
        return self


class CancelMessage(Strict):
    """``{"type": "cancel", "id": <tag>}``."""

    type: Literal["cancel"]
    id: ClientTag


class AuthMessage(Strict):
    """``{"type": "auth", "api_key": "..."}``: the first message when keys are configured;
    on a server without keys, the caller's key for a relay that passes it on."""

    type: Literal["auth"]
    api_key: str


SocketMessage = ReplyMessage | CancelMessage | AuthMessage

SOCKET_MESSAGES: Mapping[str, type[SocketMessage]] = {
    "auth": AuthMessage,
    "reply": ReplyMessage,
    "cancel": CancelMessage,
}
