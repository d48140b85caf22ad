"""The delivery benchmark without the ``bench`` extra: its Starlette baseline is refused in one
line naming the extra, before any server starts, instead of a child's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).parent.parent / "benchmarks" / "delivery" / "run.py"

# Makes ``uvicorn`` unimportable in the benchmark and every process it starts, as in an
# environment without the bench extra.
HIDE_UVICORN = """
import sys

class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "uvicorn" or name.startswith("uvicorn."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hide())
"""


def test_the_starlette_baseline_without_the_bench_extra_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE_UVICORN)
    paths = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    done = subprocess.run(
        [sys.executable, str(RUN), "--servers", "starlette", "--concurrency", "2"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "--servers starlette: uvicorn not installed" in last
    assert "[bench]" in last
