"""The systemd unit docs/deploy/replicas.md shows checks the command it runs.

Its first ``ExecReload`` is said to be ``ExecStart``'s command with ``--check``: a flag left
out of it (the port, the Redis URL) checks another configuration than the one serving.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def unit_commands() -> dict[str, list[list[str]]]:
    text = (REPO / "docs" / "deploy" / "replicas.md").read_text()
    blocks = [b for b in re.findall(r"```ini\n(.*?)```", text, re.DOTALL) if "ExecReload" in b]
    assert len(blocks) == 1, blocks
    commands: dict[str, list[list[str]]] = {}
    for line in blocks[0].replace("\\\n", " ").splitlines():
        key, _, value = line.partition("=")
        if key.startswith("Exec"):
            commands.setdefault(key, []).append(shlex.split(value))
    return commands


def test_the_reload_check_is_the_start_command_with_check():
    commands = unit_commands()
    [start] = commands["ExecStart"]
    check, signal = commands["ExecReload"]
    assert signal[0] == "/bin/kill"
    assert check[:2] == start[:2] == ["/usr/local/bin/replystream", "serve"]
    assert check.count("--check") == 1
    assert [word for word in check if word != "--check"] == start
