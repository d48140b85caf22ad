"""How a refusal names the field the client sent, whoever refused.

An engine's refusal names a field of the ``GenerationRequest`` (``prompt``, ``max_tokens``): a
route takes some of them under its own names (chat's ``messages``, Responses'
``max_output_tokens``) and says which (``FieldNames.engine``); any other it takes as named. A
relay's refusal quotes its upstream, which names a field of the chat request it was sent
(``RequestRejected.names_upstream_field``): a route whose client speaks chat takes those as an
engine's; any other says which it knows by which of its own names (``FieldNames.upstream``),
and leaves the rest out, as they would name a field its client never sent (a place in chat's
``messages``, which are not the client's list; a field the route fills from either of two).
This file must not know any route's schema: the routes bring their names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from replystream.engine.base import RequestRejected
from replystream.server.errors import HTTPAPIError


@dataclass(frozen=True, slots=True)
class FieldNames:
    """A route's client's names for the fields a refusal may name: ``engine``, a
    ``GenerationRequest``'s field to the client's (others as named); ``upstream``, a field of
    a relay's chat request to the client's (others left out), or None where the client
    speaks chat (``engine``'s then apply)."""

    engine: Mapping[str, str] = field(default_factory=dict)
    upstream: Mapping[str, str] | None = None

    def client_field(self, refused: HTTPAPIError) -> str | None:
        """The field ``refused`` names, as the client sent it (None: none it sent)."""
        param = refused.param
        if param is None:
            return None
        if refused.names_upstream_field and self.upstream is not None:
            return self.upstream.get(param)
        return self.engine.get(param, param)


def refused(exc: RequestRejected) -> HTTPAPIError:
    """An engine's refusal as our error, its field as the engine named it (a route renames
    it: ``refusals_naming``)."""
    return HTTPAPIError(
        exc.status,
        str(exc),
        code=exc.code,
        param=exc.param,
        retry_after_s=exc.retry_after_s,
        names_upstream_field=exc.names_upstream_field,
    )


@contextmanager
def refusals_naming(names: FieldNames) -> Iterator[None]:
    """Refusals raised inside name the fields as the route's client sent them (``names``)."""
    try:
        yield
    except HTTPAPIError as refusal:
        refusal.param = names.client_field(refusal)
        raise
