"""What README.md and docs/ point a reader at exists: links and their headings, the flags of
the command lines they show, the repository's files, and the tests they cite.

A heading renamed, a flag renamed or dropped, a module moved or a test renamed leaves a page
that sends its reader nowhere; each check here reads every page and names the page, the line
and what it points at.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

from replystream.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ *```.*?^ *```", re.MULTILINE | re.DOTALL)  # indented in a list item too


def where(page: Path, text: str, offset: int) -> str:
    return f"{page.relative_to(REPO)}:{text.count(chr(10), 0, offset) + 1}"


def without_code_blocks(text: str) -> str:
    """``text`` with each fenced block blanked, its line breaks kept (so lines still count)."""
    return FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, spaces to hyphens, other punctuation
    (backticks, dots, slashes, colons, parentheses...) dropped, hyphens and underscores kept."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join("-" if c == " " else c for c in text if c.isalnum() or c in " -_")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", without_code_blocks(page.read_text()), re.M):
        name = slug(heading)
        found.add(name if name not in seen else f"{name}-{seen[name]}")
        seen[name] = seen.get(name, 0) + 1
    return found


def test_every_link_between_pages_reaches_a_file_and_its_heading() -> None:
    wrong = []
    for page in PAGES:
        text = without_code_blocks(page.read_text())
        for link in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = link.group(1)
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                wrong.append(f"{where(page, text, link.start())}: no file {target}")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                wrong.append(f"{where(page, text, link.start())}: no heading for {target}")
    assert not wrong, "\n".join(wrong)


def command_lines(page: Path) -> Iterator[tuple[str, str]]:
    """(where, text) of each line of a code block, and each inline code span, of ``page``: a
    code block's line ending in ``\\``, or followed by an indented ``[--option]``, runs on."""
    text = page.read_text()
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start()) + 1
        lines = block.group(0).splitlines()
        joined, begun = "", 0
        for number, line in enumerate(lines):
            joined, begun = (joined + " " + line, begun) if joined else (line, number)
            following = lines[number + 1] if number + 1 < len(lines) else ""
            if not (line.endswith("\\") or re.match(r"\s+\[", following)):
                yield f"{page.relative_to(REPO)}:{first + begun}", joined
                joined = ""
    prose = without_code_blocks(text)
    for span in re.finditer(r"`([^`]+)`", prose):
        yield where(page, prose, span.start()), span.group(1)


def options_of_each_command() -> dict[str, set[str]]:
    options = {}
    for name, module_name, _ in COMMANDS:
        parser = argparse.ArgumentParser()
        importlib.import_module(module_name).add_arguments(parser)
        options[name] = set(parser._option_string_actions)
    return options


def test_every_flag_a_shown_command_line_gives_is_one_its_command_takes() -> None:
    options = options_of_each_command()
    names = "|".join(sorted(options, key=len, reverse=True))  # lab-engine before lab
    # A command runs to the end of its line or span, a comment, or another command after it.
    command = re.compile(rf"\breplystream ({names})\b(.*?)(?=\s#|&&|\|\||\breplystream |$)")
    wrong = []
    checked = 0
    for page in PAGES:
        for place, line in command_lines(page):
            for found in command.finditer(line):
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", found.group(2)):
                    checked += 1
                    if flag not in options[found.group(1)]:
                        wrong.append(f"{place}: replystream {found.group(1)} has no {flag}")
    assert checked > 100, "the command lines of the pages were not found"
    assert not wrong, "\n".join(wrong)


# Paths from the repository's root, and the module paths the pages write from inside the
# package (``server/replies``, ``delivery/follower.run``).
ROOTED = r"(?:src|tests|scripts|benchmarks|docs|fuzz)/[\w./{},*-]+"
IN_PACKAGE = r"(?:server|delivery|engine|client|lab|sse|web)/[\w./-]+"


def exists(path: str) -> bool:
    braces = re.fullmatch(r"(.*)\{(.*?)\}(.*)", path)
    if braces:
        start, choices, end = braces.groups()
        return all(exists(start + choice + end) for choice in choices.split(","))
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def in_package(path: str) -> bool:
    """``server/replies``, ``server/replies.py``, ``server/replies.on_deltas``, ``engine/``: a
    module or package of ours; ``delivery/run.py``: a benchmark's, named inside benchmarks/."""
    module = path.rstrip("/").removesuffix(".py").split(".")[0]
    package = REPO / "src" / "replystream" / module
    return (
        package.with_suffix(".py").exists()
        or package.is_dir()
        or (REPO / "benchmarks" / module).with_suffix(".py").exists()
    )


# performance.md measures revisions before this one, and names the files they had.
HISTORY = {"performance.md"}


def test_every_file_and_module_a_page_names_exists() -> None:
    wrong = []
    for page in PAGES:
        if page.name in HISTORY:
            continue
        text = page.read_text()
        for span in re.finditer(r"`([^`\n]+)`", text):
            for path in re.findall(rf"(?<![\w./<>-])({ROOTED})", span.group(1)):
                if not exists(path.rstrip(".,:;)")):
                    wrong.append(f"{where(page, text, span.start())}: no {path}")
            for path in re.findall(rf"(?<![\w./<>-])({IN_PACKAGE})", span.group(1)):
                if not in_package(path.rstrip(".,:;)")):
                    wrong.append(f"{where(page, text, span.start())}: no {path}")
    assert not wrong, "\n".join(wrong)


def test_every_test_a_page_cites_exists() -> None:
    defined = {
        test.name: set(re.findall(r"^(?:async )?def (test_\w+)", test.read_text(), re.M))
        for test in (REPO / "tests").glob("test_*.py")
    }
    every = set().union(*defined.values())
    wrong = []
    for page in PAGES:
        text = page.read_text()
        for cited in re.finditer(r"`(?:tests/)?(test_\w+\.py)(?:::(\w+?)(\.\.\.)?)?`", text):
            file, name, begins = cited.groups()
            names = defined.get(file)
            if names is None:
                wrong.append(f"{where(page, text, cited.start())}: no tests/{file}")
            elif name and not any(n == name or (begins and n.startswith(name)) for n in names):
                wrong.append(f"{where(page, text, cited.start())}: {file} has no {name}")
        for cited in re.finditer(r"`(test_[a-z0-9_]+?)(\.\.\.)?`", text):
            name, begins = cited.groups()
            if not any(n == name or (begins and n.startswith(name)) for n in every):
                wrong.append(f"{where(page, text, cited.start())}: no test {name}")
    assert not wrong, "\n".join(wrong)
