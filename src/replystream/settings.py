"""Settings declared once: the flag, what it accepts, its default, its help, and the config
field it fills. The command line, the mapping from parsed arguments to configs, and the
settings reference in the docs are all built from these declarations.

This file decides how a table of ``Setting`` rows becomes argparse arguments, how parsed
arguments fill a frozen config dataclass (``fill``), and how the table reads as Markdown.
A row that fills a config field takes that field's default and type, so a default is stated
in one place: the config. It imports nothing of ours, so any layer may declare settings, and
it must not know what any setting means.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

C = TypeVar("C")

# Where the namespace keeps the single-valued settings the command line gave: dest -> row.
_GIVEN = "settings_given"


class Checker(Protocol):
    """An argparse type that can say what it accepts (``cli_values`` holds them)."""

    @property
    def wants(self) -> str: ...

    def __call__(self, text: str, /) -> Any: ...


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of a command.

    Attributes:
        flag: the option (``--batch-tokens``); its dest is the flag without dashes.
        help: what it does, in a line; argparse adds the default unless the help names it.
        parse: the checker of a value (None: the text as given).
        fills: the config field it fills, as (class, field name); the setting takes that
            field's default. None: the command reads it itself, and ``default`` is its own.
        default: the default of a setting that fills no field.
        convert: turns the parsed value into the field's value (0 into None, a list into a
            tuple).
        choices: the values it accepts, when a fixed few.
        repeatable: may be given more than once (a list; empty by default).
        switch: takes no value; given means on.
        metavar: the value's name in the help.
        engines: the engines it belongs to; empty: every engine. The command refuses it for
            any other (``given`` tells which settings the command line gave).
        accepts: what it accepts in words, when neither ``parse`` nor ``choices`` say.
        hidden: left out of the help and the docs (set by the command for itself).
    """

    flag: str
    help: str
    parse: Checker | None = None
    fills: tuple[type[Any], str] | None = None
    default: Any = UNSET
    convert: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] = ()
    repeatable: bool = False
    switch: bool = False
    metavar: str | None = None
    engines: tuple[str, ...] = ()
    accepts: str = ""
    hidden: bool = False

    def __post_init__(self) -> None:
        if self.fills is not None:
            if self.default is not UNSET:
                raise ValueError(f"{self.flag}: a setting that fills a field takes its default")
            default = self.field_default()  # the field exists and has a default
            # A list starts empty and a switch off: the field's default must be that too.
            if (self.repeatable and default not in ((), [])) or (self.switch and default):
                raise ValueError(f"{self.flag}: {self.field_name} must default to empty or off")
        if self.switch and (self.repeatable or self.parse or self.choices):
            raise ValueError(f"{self.flag}: a switch takes no value")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def field_name(self) -> str:
        """``Class.field`` this setting fills, or ""."""
        return "" if self.fills is None else f"{self.fills[0].__name__}.{self.fills[1]}"

    def field_default(self) -> Any:
        assert self.fills is not None
        cls, name = self.fills
        for item in dataclasses.fields(cls):
            if item.name == name:
                if item.default is not dataclasses.MISSING:
                    return item.default
                if item.default_factory is not dataclasses.MISSING:
                    return item.default_factory()
                raise ValueError(f"{self.flag}: {self.field_name} has no default")
        raise ValueError(f"{self.flag}: {cls.__name__} has no field {name!r}")

    def initial(self) -> Any:
        """The value when the command line does not give it."""
        if self.repeatable:
            return []
        if self.switch:
            return False
        if self.fills is not None:
            return self.field_default()
        return None if self.default is UNSET else self.default

    def value(self, args: argparse.Namespace) -> Any:
        """The parsed value, as the config field wants it."""
        value = getattr(args, self.dest)
        return value if self.convert is None else self.convert(value)

    def what_it_accepts(self) -> str:
        """What it accepts, in words (the reference's column)."""
        if self.choices:
            return "one of " + ", ".join(f"`{choice}`" for choice in self.choices)
        if self.switch:
            return "a switch (no value)"
        if self.accepts:
            return self.accepts
        return "text" if self.parse is None else self.parse.wants


@dataclass(frozen=True, slots=True)
class Group:
    """Settings shown together in the help under ``title`` ("": the command's own)."""

    title: str
    settings: tuple[Setting, ...]


Table = Sequence[Group]


def rows(table: Table) -> Iterator[Setting]:
    for group in table:
        yield from group.settings


class _Given(argparse.Action):
    """Stores a value and notes that the command line gave this setting."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.setting: Setting = kwargs.pop("setting")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True if self.setting.switch else values)
        given = dict(getattr(namespace, _GIVEN, None) or {})
        given[self.dest] = self.setting
        setattr(namespace, _GIVEN, given)


def add_arguments(parser: argparse.ArgumentParser, table: Table) -> None:
    """One argument per row, in the table's groups and order."""
    for group in table:
        target: Any = parser.add_argument_group(group.title) if group.title else parser
        for row in group.settings:
            options: dict[str, Any] = {
                "dest": row.dest,
                "default": row.initial(),
                "help": argparse.SUPPRESS if row.hidden else row.help,
            }
            if row.switch:  # recorded too: an engine's switch given to another is refused
                target.add_argument(row.flag, action=_Given, setting=row, nargs=0, **options)
                continue
            options.update(type=row.parse, choices=row.choices or None, metavar=row.metavar)
            if row.repeatable:
                target.add_argument(row.flag, action="append", **options)
            else:
                target.add_argument(row.flag, action=_Given, setting=row, **options)


def given(args: argparse.Namespace) -> list[Setting]:
    """The single-valued settings and switches the command line gave, whatever their values."""
    recorded: dict[str, Setting] = getattr(args, _GIVEN, None) or {}
    return list(recorded.values())


def fill(cls: type[C], args: argparse.Namespace, table: Table, **built: Any) -> C:
    """A ``cls`` from the rows that fill its fields, and ``built``: the fields the command
    makes itself (nested configs, values read from several settings)."""
    values = {
        row.fills[1]: row.value(args) for row in rows(table) if row.fills and row.fills[0] is cls
    }
    return cls(**{**values, **built})


def default_worth_stating(default: Any, help_text: str) -> bool:
    """Whether the help and the reference state a default: not when it is nothing (off,
    empty, none), nor when the help already speaks of it."""
    nothing = default is None or default is False or default in ([], (), argparse.SUPPRESS)
    return not nothing and "default" not in help_text.lower()


def shown_default(row: Setting) -> str:
    """The default as the reference states it ("" when the help does not state it either)."""
    default = row.initial()
    return f"`{default}`" if default_worth_stating(default, row.help) else ""


def markdown(table: Table, command: str) -> str:
    """The table as Markdown: one section per group, one row per visible setting."""
    out: list[str] = []
    for group in table:
        visible = [row for row in group.settings if not row.hidden]
        if not visible:
            continue
        title = group.title or f"{command}: the server and its process"
        out += [f"### {title}", "", "| Flag | Accepts | Default | What it does | Fills |"]
        out.append("|---|---|---|---|---|")
        for row in visible:
            flag = f"`{row.flag}`" + (" (repeatable)" if row.repeatable else "")
            fills = f"`{row.field_name}`" if row.fills else "-"
            text = row.help.replace("|", "\\|")
            out.append(
                f"| {flag} | {row.what_it_accepts()} | {shown_default(row)} | {text} | {fills} |"
            )
        out.append("")
    return "\n".join(out) + "\n"


def with_current_table(document: str, table_markdown: str, begin: str, end: str) -> str:
    """``document`` with the text between the lines ``begin`` and ``end`` replaced.

    Raises:
        ValueError: the markers are missing, or out of order.
    """
    start, stop = document.find(begin), document.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"the document needs the lines {begin!r} and {end!r}")
    return f"{document[: start + len(begin)]}\n{table_markdown}{document[stop:]}"
