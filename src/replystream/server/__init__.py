"""The HTTP server: routes, error shape and the serving loop."""

from replystream.server.app import create_app
from replystream.server.serve import running, serve_forever

__all__ = ["create_app", "running", "serve_forever"]
