"""docs/ARCHITECTURE.md's tables of a reply's endings, held to ``ENDINGS`` in the code.

The table of rows is generated (``scripts/reply_endings_table.py``) and must be current; the
hand-written table of triggers must name every way once, with its metric outcome and, for an
in-band error, its code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from replystream.server.reply_endings import ENDINGS, markdown_table, with_current_table

DOCUMENT = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"
TRIGGERS_HEADER = "| Ending | Way | Trigger | Streamed reply | Buffered reply | Metric outcome |"


def trigger_rows() -> list[dict[str, str]]:
    lines = DOCUMENT.read_text().splitlines()
    start = lines.index(TRIGGERS_HEADER)
    names = [cell.strip() for cell in TRIGGERS_HEADER.strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == len(names), f"a row of the table of triggers: {line}"
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def test_the_generated_table_of_endings_in_the_architecture_is_current() -> None:
    document = DOCUMENT.read_text()
    assert markdown_table() in document
    assert with_current_table(document) == document, (
        "docs/ARCHITECTURE.md is stale: run python scripts/reply_endings_table.py"
    )


def test_the_table_of_triggers_names_every_way_once_with_its_outcome_and_code() -> None:
    rows = trigger_rows()
    named = [way for row in rows for way in row["Way"].strip("`").split("`, `") if way != "-"]
    assert sorted(named) == sorted(ENDINGS), "each way of ending must have exactly one row"
    for row in rows:
        for way in row["Way"].strip("`").split("`, `"):
            if way == "-":
                continue
            rule = ENDINGS[way]  # type: ignore[index]
            assert f"`{rule.outcome}`" in row["Metric outcome"], (way, row["Metric outcome"])
            if rule.in_band == "error" and "{" not in rule.code:
                assert f"`{rule.code}`" in row["Streamed reply"], (way, row["Streamed reply"])


def test_a_document_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the lines"):
        with_current_table("# no table here\n")
