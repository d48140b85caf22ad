"""Reply and request ids: their shape, uniqueness, and no shared bytes across a fork."""

import os
import re
import uuid

from replystream.server import ids


def test_ids_have_their_shapes_and_do_not_repeat():
    replies = [ids.reply_id() for _ in range(10_000)]  # several blocks of OS randomness
    requests = [ids.request_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{24}", r) for r in replies)
    # A request id is a version 4 UUID as it is usually written.
    assert all(str(uuid.UUID(r)) == r and uuid.UUID(r).version == 4 for r in requests)
    assert len(set(replies)) == len(replies) and len(set(requests)) == len(requests)


def test_a_forked_child_does_not_hand_out_its_parents_next_id():
    ids.reply_id()  # the parent holds a partly used block
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id and leave at once
        os.write(write_end, ids.reply_id().encode())
        os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.waitpid(pid, 0)
    os.close(read_end)
    assert child_id and child_id != ids.reply_id()
