"""A WebSocket client message in, a validated message (``server.native_schemas``) or an error out.

Every message but ``auth`` names its reply with the client's tag ``id``; the tag is read
first, so an error about the rest of the message can be sent for that tag (the client's other
replies are not concerned). A message is told by its decoded ``type``, never by its bytes, so
every JSON spelling of a message is the same message. This file must not know about the
socket or the replies running on it.
"""

from __future__ import annotations

from replystream.server.errors import HTTPAPIError
from replystream.server.native_schemas import (
    SOCKET_MESSAGES,
    AuthMessage,
    SocketEnvelope,
    SocketMessage,
)
from replystream.server.validation import parse_json, refuse_repeated_fields


class BadMessage(Exception):
    """A message the server cannot take; ``tag`` is its ``id`` when that much was valid, and
    ``kind`` its ``type`` when that was (a ``reply`` refused has an access-log line)."""

    def __init__(self, tag: str | None, error: HTTPAPIError, kind: str | None = None) -> None:
        super().__init__(error.message)
        self.tag = tag
        self.error = error
        self.kind = kind


def parse_message(data: str | bytes) -> SocketMessage:
    """An ``auth``, ``reply`` or ``cancel`` message. Raises ``BadMessage``."""
    try:
        envelope = parse_json(data, SocketEnvelope, what="message", whole=False)
    except HTTPAPIError as exc:
        raise BadMessage(None, exc) from None
    try:
        # Before the type picks the schema: a message naming ``type`` twice would otherwise
        # be read as one of its types, and refused as that.
        refuse_repeated_fields(data, "message")
    except HTTPAPIError as exc:  # the tag is the message's unless it is what is repeated
        raise BadMessage(None if exc.param == "id" else envelope.id, exc) from None
    if "type" not in envelope.model_fields_set:  # a missing field, as a body's is named
        error = HTTPAPIError(
            400, "type is required", code="missing_required_parameter", param="type"
        )
        raise BadMessage(envelope.id, error)
    model = SOCKET_MESSAGES.get(envelope.type) if isinstance(envelope.type, str) else None
    if model is None:
        error = HTTPAPIError(
            400,
            'type must be "auth", "reply" or "cancel"',
            code="invalid_value",
            param="type",
        )
        raise BadMessage(envelope.id, error)
    try:
        return parse_json(data, model, what="message", whole=False)  # its fields are checked
    except HTTPAPIError as exc:
        raise BadMessage(envelope.id, exc, envelope.type) from None


def auth_key(data: str | bytes) -> str | None:
    """The key of an ``auth`` message; None for anything else."""
    try:
        return parse_json(data, AuthMessage, what="message").api_key
    except HTTPAPIError:
        return None
