"""Write the table of a reply's endings into docs/ARCHITECTURE.md from ``ENDINGS``.

Run after changing ``server/reply_endings.py``: ``python scripts/reply_endings_table.py``.
tests/test_reply_endings_doc.py fails while the document shows another table.
"""

from __future__ import annotations

from pathlib import Path

from replystream.server.reply_endings import with_current_table

DOCUMENT = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


def main() -> None:
    text = DOCUMENT.read_text()
    current = with_current_table(text)
    if current == text:
        print(f"{DOCUMENT.name}: the table of endings is current")
        return
    DOCUMENT.write_text(current)
    print(f"{DOCUMENT.name}: the table of endings rewritten")


if __name__ == "__main__":
    main()
