vcl 4.1;

# replystream behind Varnish (7.1, Debian's).
#
# Install: copy to /etc/varnish/default.vcl (or load it with varnishadm), point the backend at
# `replystream serve`, and start varnishd with `-a :8080 -p pipe_timeout=3600` (below: a
# buffered reply sends nothing until it is whole, longer than the default 60 s). Check that
# it streams:
#   replystream doctor 'http://HOST:8080/stream?max_tokens=400' \
#       --direct 'http://127.0.0.1:8000/stream?max_tokens=400'
# tests/test_varnish.py loads this file (port substituted) and runs that check.
#
# A reply is never worth caching, so every generation route is piped: Varnish passes the bytes
# both ways as they come. A passed (fetched) stream would stream too, but a client that left
# while the app was silent (a long prefill, a queue) would be noticed only after a few failed
# keep-alive writes, some 45 s, the generation running on; a pipe closes the app's connection
# as soon as the client's closes, which cancels it. Varnish adds the client's address to
# X-Forwarded-For before any of this (the app reads it with --trusted-proxy).

backend replystream {
    .host = "127.0.0.1";
    .port = "8000";  # replystream serve --port 8000 --trusted-proxy 127.0.0.1 --allowed-host NAME
}

sub vcl_recv {
    # Streams, buffered replies, resumes, the WebSocket transport. A pipe's idle limit is
    # the pipe_timeout parameter: streams send a keep-alive and WebSockets a ping every 15 s
    # (--keepalive-s), inside its default 60 s, but a buffered reply (/wait, "stream": false)
    # is silent until it is whole, hence -p pipe_timeout=3600.
    if (req.http.Upgrade ~ "(?i)websocket"
        || req.url ~ "^/(stream|wait)(\?|$)"
        || req.url ~ "^/v1/(replies|chat/completions|completions|responses|messages|ws)") {
        return (pipe);
    }
}

sub vcl_pipe {
    # Varnish sends piped requests with Connection: close and without the client's Upgrade;
    # a WebSocket needs both passed on.
    if (req.http.Upgrade) {
        set bereq.http.Upgrade = req.http.Upgrade;
        set bereq.http.Connection = req.http.Connection;
    }
}

sub vcl_backend_response {
    # Anything else that is an event stream: pass each event on as it arrives (the default,
    # said here), and never gzip it, as Varnish's gzip holds the whole reply until it ends.
    if (beresp.http.Content-Type ~ "(?i)^text/event-stream") {
        set beresp.do_stream = true;
        set beresp.do_gzip = false;
        set beresp.uncacheable = true;
        return (deliver);
    }
}
