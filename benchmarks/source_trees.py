"""The ``--src LABEL=PATH`` arguments of the benchmarks that compare source trees side by side
(each labelled source runs replystream from PATH, interleaved with the others)."""

from __future__ import annotations

import argparse
from pathlib import Path


def source_trees(parser: argparse.ArgumentParser, specs: list[str]) -> list[tuple[str, str]]:
    """``specs`` as (label, path), or the parser's one-line error naming ``--src``.

    Without a label a source's rows cannot be told apart, and two sources under one label
    would be mixed into one row; without replystream in PATH the servers would run the
    installed one under the label, measuring something else."""
    trees: list[tuple[str, str]] = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not Path(path, "replystream").is_dir():
            parser.error(
                f"argument --src: want LABEL=PATH to a folder holding replystream, got {spec!r}"
            )
        if any(label == seen for seen, _ in trees):
            parser.error(f"argument --src: the label {label!r} is given twice")
        trees.append((label, path))
    return trees
