"""Random identifiers for replies and requests, drawn from the operating system in blocks.

Every request needs one or two: a reply id (144 bits, so not guessable) and a request id.
``os.urandom`` is a system call, and system calls are what a busy server runs out of time
on; taking 4 KiB at once and handing out each byte once costs one call per ~150 requests.
The bytes are the same OS randomness either way. Used from the event loop's thread only; a
forked child starts with an empty block, so parent and child never share bytes.
"""

from __future__ import annotations

import base64
import os

BLOCK_BYTES = 4096


class _Pool:
    def __init__(self) -> None:
        self.block = b""
        self.used = 0

    def take(self, count: int) -> bytes:
        if self.used + count > len(self.block):
            self.block, self.used = os.urandom(max(BLOCK_BYTES, count)), 0
        start = self.used
        self.used += count
        return self.block[start : self.used]

    def forget(self) -> None:
        self.block, self.used = b"", 0


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.forget)


REPLY_ID_BYTES = 18
# Every reply id's length: the ids of a response's items hold it at a known place.
REPLY_ID_CHARS = 4 * REPLY_ID_BYTES // 3


def reply_id() -> str:
    """144 random bits, base64url (24 characters): not guessable, not enumerable."""
    return base64.urlsafe_b64encode(_pool.take(REPLY_ID_BYTES)).decode("ascii")


def request_id() -> str:
    """A random UUID (version 4) in its usual form: 8-4-4-4-12 hex digits. The form many
    servers expect of ``X-Request-Id`` (Envoy makes it; llama-cpp-python's server refuses a
    request whose id is not a UUID), which a relay passes on to its upstreams."""
    raw = bytearray(_pool.take(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # the variant of RFC 9562
    digits = raw.hex()
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"
