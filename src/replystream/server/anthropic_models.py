"""``GET /v1/models`` and ``GET /v1/models/{model}`` as Anthropic's API answers them, for its
clients (``errors.speaks_anthropic``: they send ``anthropic-version``): a model is
``{"type": "model", "id", "display_name", "created_at", ...}``, a list a page of them with
``has_more``, ``first_id`` and ``last_id``, paged by ``limit``, ``after_id`` and
``before_id`` as the SDK's auto-pagination asks, and kept to the ``lifecycle`` stages asked
for. Which models are served is ``server.openai_api``'s; this file only writes them. It must
not know about engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from replystream.server.errors import HTTPAPIError
from replystream.server.query_schemas import AnthropicModelsQuery

# Every model served here is in use: none is deprecated or retired.
LIFECYCLE = "active"


def model_info(name: str, created: int) -> dict[str, Any]:
    """A model as Anthropic's ``ModelInfo``: ``created_at`` in RFC 3339 (when this server
    started, as the OpenAI shape's ``created`` is); it has no other display name."""
    created_at = datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": created_at,
        "lifecycle": LIFECYCLE,
    }


def model_page(names: Sequence[str], created: int, query: AnthropicModelsQuery) -> dict[str, Any]:
    """The page of ``names`` the query asks for: after ``after_id`` and before ``before_id``,
    the first ``limit`` (with ``before_id`` alone, the last: the page just before it);
    ``has_more`` when that left some out on the side it pages to. An empty page when the
    ``lifecycle`` stages asked for leave out the one every model here is in.

    Raises:
        HTTPAPIError: ``after_id`` or ``before_id`` is no listed model (a 400 naming it).
    """
    start = 0 if query.after_id is None else _place(names, query.after_id, "after_id") + 1
    end = len(names) if query.before_id is None else _place(names, query.before_id, "before_id")
    window = list(names[start:end]) if LIFECYCLE in query.lifecycle else []
    backwards = query.before_id is not None and query.after_id is None
    shown = window[-query.limit :] if backwards else window[: query.limit]
    return {
        "data": [model_info(name, created) for name in shown],
        "has_more": len(window) > len(shown),
        "first_id": shown[0] if shown else None,
        "last_id": shown[-1] if shown else None,
    }


def _place(names: Sequence[str], cursor: str, param: str) -> int:
    if cursor in names:
        return names.index(cursor)
    shown = cursor if len(cursor) <= 80 else cursor[:77] + "..."
    message = f"{param} must be the id of a model GET /v1/models lists, got {shown!r}"
    raise HTTPAPIError(400, message, code="invalid_value", param=param)
