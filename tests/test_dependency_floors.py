"""The lowest version pyproject.toml lets pip install of each dependency is one that works.

pip keeps an installed release that meets a floor, so a floor below what the code uses breaks
the install of a user who has that older release already: each minimum here is the first
release that has what replystream uses, found by installing the release before it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"

# package: (first release that works, what the release before it lacks)
NEEDED = {
    "aiohttp": ((3, 14), "web.RequestKey and web.ResponseKey (the server does not import)"),
    "pydantic": ((2, 12), "pydantic_core.to_json(ensure_ascii=...) (every OpenAI chunk fails)"),
    "tokenizers": ((0, 20), "reading tokenizer.json merges written as pairs (the tiny engine)"),
    "gguf": ((0, 11), "0.10 imports sentencepiece, which it does not declare, and has no TQ1_0"),
    "httptools": ((0, 6, 3), "a 1xx interim response before the relay's answer (it waits)"),
    "redis": ((8, 1), "the asyncio Sentinel's aclose(), and a bad URL query told in one line"),
}


def declared_floors() -> dict[str, tuple[int, ...]]:
    floors: dict[str, tuple[int, ...]] = {}
    for requirement in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]:
        found = re.match(r"([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*>=\s*([0-9.]+)", requirement)
        if found:
            floors[found[1].lower()] = tuple(int(part) for part in found[2].split("."))
    return floors


def test_each_dependency_floor_is_a_release_that_has_what_the_code_uses():
    floors = declared_floors()
    low = {
        name: f"declared >= {'.'.join(map(str, floors.get(name, ())))}, needs "
        f"{'.'.join(map(str, least))}: {why}"
        for name, (least, why) in NEEDED.items()
        if floors.get(name, ()) < least
    }
    assert low == {}
