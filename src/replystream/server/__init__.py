"""The HTTP server: routes, error shape and the serving loop."""

from replystream.server.app import create_app
from replystream.server.serve import RunningServer, running, serve_forever, serving

__all__ = ["RunningServer", "create_app", "running", "serve_forever", "serving"]
