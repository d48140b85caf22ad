"""Client input enters the server one way: through ``server.validation`` and its schemas.

A route that read a body itself, or parsed JSON from a client itself, would skip the schema
(and its depth, number and encoding rules); this test fails when one does.
"""

import re
from pathlib import Path

import replystream.server

SERVER = Path(replystream.server.__file__).parent
BODY_READS = re.compile(r"\bread_body\(|\brequest\.(read|json|text|post)\(|\.content\.read")
JSON_PARSES = re.compile(r"\bjson\.loads\(|\bmodel_validate(_json)?\(")
# Where each may appear: the body reader itself, and the one module that parses input.
BODY_READERS = {"guard.py", "validation.py"}
PARSERS = {"validation.py"}
# websocket.py parses the frames of our own reply log (never client input) back into data.
OWN_DATA = {("websocket.py", "json.loads(event.data)")}


def offending(pattern: re.Pattern[str], allowed: set[str]) -> list[str]:
    found = []
    for path in sorted(SERVER.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if not pattern.search(code) or path.name in allowed:
                continue
            if any(path.name == name and text in code for name, text in OWN_DATA):
                continue
            found.append(f"{path.name}:{number}: {line.strip()}")
    return found


def test_request_bodies_are_read_only_by_the_validation_module():
    assert offending(BODY_READS, BODY_READERS) == []


def test_client_json_is_parsed_only_by_the_validation_module():
    assert offending(JSON_PARSES, PARSERS) == []
