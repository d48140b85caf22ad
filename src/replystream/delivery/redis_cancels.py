"""Cancels asked on another replica, heard at once: a Redis channel beside the cancel's key.

A cancel asked on a replica that does not produce the reply is a key in Redis (``P{id}:cancel``)
that the producer's heartbeat reads once a second (``redis_heartbeat``): it lasts, but it may
come a second late, and the producer makes tokens for nobody meanwhile (a Responses ``cancel``
is answered that much later). The replica asked also publishes the reply's id on one channel
(``P`` then ``cancels``), which every replica that produces replies listens to; the one that
holds the reply stops it as the message comes. The channel only makes it sooner: a message
lost (no replica listening yet, a listener reconnecting after a failover, pub/sub delivering
at most once) leaves the key to the next beat, as before. This file must not know what the
keys hold or how a producer is stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from replystream.delivery.redis_connect import error_text
from replystream.delivery.redis_link import HEARTBEAT_S, RedisLink
from replystream.outage_log import OutageLog

log = logging.getLogger("replystream.redis_store")

# How long one wait for a message lasts before the listener looks again: bounded, so that the
# connection's command timeout never takes a quiet channel for a dead Redis.
_WAIT_S = 1.0


class CancelChannel:
    """The channel cancels are published on, and this replica's listener to it."""

    def __init__(self, link: RedisLink, channel: str, on_cancel: Callable[[str], None]) -> None:
        """``on_cancel``: called with each reply id heard (any replica's: it stops the reply
        if it is one produced here)."""
        self._redis = link.redis
        self.channel = channel
        self._on_cancel = on_cancel
        self.listening = asyncio.Event()  # set while subscribed
        # A listener that cannot subscribe (Redis down, an ACL without the channel) is told
        # once as it begins and once as it ends: cancels still come, at the heartbeats.
        self._outage = OutageLog(log, "listening for cancels on a Redis channel", error_text)

    async def publish(self, reply_id: str) -> None:
        """Tell the replica producing ``reply_id`` now; a failure is no cancel's failure
        (its key, already written, is read at the producer's next beat)."""
        try:
            await self._redis.publish(self.channel, reply_id)
        except (RedisError, OSError) as exc:
            log.debug("a cancel of %s was not published (its key stands): %s", reply_id, exc)

    async def listen_forever(self) -> None:
        """Hear cancels until cancelled; subscribed again a beat after Redis failed."""
        while True:
            try:
                await self._listen()
            except (RedisError, OSError) as exc:
                self._outage.failed(exc)
            finally:
                self.listening.clear()
            await asyncio.sleep(HEARTBEAT_S)

    async def _listen(self) -> None:
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            while True:
                message = await pubsub.get_message(timeout=_WAIT_S)
                if message is None:
                    continue
                if message.get("type") == "subscribe":
                    # Subscribed only once Redis confirms it: a refusal (an ACL without the
                    # channel, SUBSCRIBE disabled) is an error read here instead, and the
                    # listener's tries would each be told as a success, then a failure.
                    self._outage.succeeded()
                    self.listening.set()
                    continue
                if message.get("type") != "message":
                    continue
                data = message.get("data")
                if isinstance(data, bytes):
                    self._on_cancel(data.decode("utf-8", "replace"))
        finally:
            self.listening.clear()
            await pubsub.aclose()
