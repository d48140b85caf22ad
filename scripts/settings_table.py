"""Write the settings reference in docs/settings.md from ``SERVE_SETTINGS``.

Run after changing a setting (``server/serve_settings.py``, ``server/engine_settings.py``, or a
default in a config it fills): ``python scripts/settings_table.py``.
tests/test_settings_doc.py fails while the document shows another table.
"""

from __future__ import annotations

from pathlib import Path

from replystream.server.serve_settings import current_reference

DOCUMENT = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def main() -> None:
    text = DOCUMENT.read_text()
    current = current_reference(text)
    if current == text:
        print(f"{DOCUMENT.name}: the settings reference is current")
        return
    DOCUMENT.write_text(current)
    print(f"{DOCUMENT.name}: the settings reference rewritten")


if __name__ == "__main__":
    main()
