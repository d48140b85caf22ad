"""Write tests/durations.json, each test file's summed run time, from a JUnit XML report.

The suite hands whole files to its workers, longest first (``tests/conftest.py``), so a file
that takes a minute does not start last and leave the others idle at the end. Refresh the
table after adding or much changing a slow test file:

    scripts/test --junitxml=/tmp/suite.xml && python scripts/test_durations.py /tmp/suite.xml
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def file_seconds(report: Path) -> dict[str, float]:
    """Seconds per test file (``test_x.py``), summed over its tests' calls and fixtures."""
    seconds: Counter[str] = Counter()
    for case in ElementTree.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")
        if len(module) >= 2 and module[0] == "tests":
            seconds[f"{module[1]}.py"] += float(case.get("time", "0"))
    return {name: round(total, 1) for name, total in sorted(seconds.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a JUnit XML report of a whole-suite run")
    args = parser.parse_args()
    if not args.report.is_file():
        parser.error(f"report: no such file: {args.report}")
    table = file_seconds(args.report)
    if not table:
        parser.error(f"report: no test of tests/ in {args.report}")
    TABLE.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{TABLE.name}: {len(table)} files, {sum(table.values()):.0f} s in all")


if __name__ == "__main__":
    main()
