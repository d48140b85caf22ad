"""The routes file docs/engines.md shows is one `serve --check` takes, with the command beside it.

A reader copies the example, fills in its certificate files and variables, and runs the
documented command; a field the example sets past a default flag's bound would stop it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.certificates import Authority

REPO = Path(__file__).resolve().parents[1]


def routes_example() -> str:
    text = (REPO / "docs" / "engines.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, "docs/engines.md has no TOML example"
    return str(blocks[0])


def test_the_documented_routes_file_passes_serve_check(tmp_path):
    (tmp_path / "routes.toml").write_text(routes_example())
    authority = Authority("replystream test CA")
    authority.write(tmp_path / "certs" / "internal-ca.pem")
    cert, key = authority.issue(tmp_path / "issued", "relay", ExtendedKeyUsageOID.CLIENT_AUTH)
    cert.rename(tmp_path / "certs" / "relay.pem")
    key.rename(tmp_path / "certs" / "relay.key")
    env = {k: v for k, v in os.environ.items() if k != "REPLYSTREAM_UPSTREAM_API_KEY"}
    env |= {"GPU_A_KEY": "sk-a", "CF_SECRET": "secret"}
    routes = str(tmp_path / "routes.toml")
    command = ["serve", "--engine", "upstream", "--upstream-routes", routes]
    done = subprocess.run(
        [sys.executable, "-m", "replystream", *command, "--upstream-continue", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
