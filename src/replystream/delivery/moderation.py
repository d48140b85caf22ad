"""Hold-back moderation: text is released only after checks have seen it with w tokens after it.

``HoldBack`` keeps the newest ``window`` tokens unreleased. Each time a token arrives, every
check reads it with as much of the text before it as the check needs, unreleased or already
released (so a phrase split across tokens, or across batch edges, is seen whole). When a
check matches, the reply stops: nothing from the start of the match on is ever released, and
the caller learns how much text was released before it. A match that reaches the end of the
text so far may hold only because the text stops there (a ``\\b``, a ``$``, a look-ahead:
"ass" of "assistant" while "istant" has not come): it is tentative. Nothing from its start on
is released, and the next text decides it: read again, it no longer matches, or it does
whatever comes next. When the text ends (the reply's end, a tool call) a tentative match is
final. A bigger window lets a check stop earlier text (a longer phrase whose end arrives
late); the cost is ``window`` tokens of delay on every token.
Stop strings are withheld by the same buffer: besides the window, the shortest tail of the
text that could still begin a stop string stays held (``engine.stops``), and is released
once it cannot; when one completes, the text before it is released and nothing after.
This file is pure: no clock, no I/O. It must not know about events or sockets.
"""

from __future__ import annotations

import re
import unicodedata
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from replystream.engine.base import TokenLogprob
from replystream.engine.stops import StopHit, StopScan

# Alternatives' verdicts kept per reply: a few thousand distinct tokens at most, in practice.
MAX_ALTERNATIVES_KEPT = 4096
# The longest a tentative match may grow before it is taken as final. Each token reads a
# tentative match again from its start, so one that kept growing (a key written on and on,
# ``\bsk-[A-Za-z0-9_-]{20,}`` over a run of 40,000 letters) cost every token its whole
# length: a reply's square. No match a model's word split leaves in doubt is this long.
MAX_TENTATIVE_CHARS = 1024


@dataclass(frozen=True, slots=True)
class Finding:
    """Where a check matched, in the text it was given, and why.

    ``tentative``: the match reaches the end of that text and may hold only because the
    text stops there; more text may undo it. A match more text cannot undo (a phrase found
    whole) is not tentative even where it ends the text."""

    start: int
    end: int
    check: str
    reason: str
    tentative: bool


class Check(Protocol):
    """One rule text must pass before release."""

    name: str
    context_chars: int  # how much already released text it needs to see again
    # How many times its rules changed since it was made (a list read again on SIGHUP): a
    # reply under way that sees a new revision reads all the text it still holds again.
    revision: int

    def find(self, text: str, start: int = 0) -> Finding | None:
        """The first match in ``text`` that begins at ``start`` or after. The text before
        ``start`` is there to be looked back at (a word boundary, a look-behind), never to
        begin a match in; a ``^`` matches only where ``text`` begins. ``text`` is the text
        so far, not the whole of it: a match that more text could undo says so
        (``Finding.tentative``)."""
        ...


# Each character's form as phrases are matched (see ``BannedPhrases``), kept once made: text
# is checked again with every token, and a reply's characters are few.
_FOLDED_FORMS: dict[str, str] = {}
_CASED_FORMS: dict[str, str] = {}


def _form_of(char: str, *, fold_case: bool) -> str:
    if unicodedata.category(char) == "Cf":
        return ""  # invisible: a zero-width space or joiner, a soft hyphen
    plain = unicodedata.normalize("NFKC", char)
    return plain.casefold() if fold_case else plain


# Whether a character joins the one before it in NFKC: a combining mark (the accent of
# "e" + U+0301, which NFKC composes into "é") or a Hangul vowel or final consonant jamo (which
# compose with the consonant before them into one syllable). Kept once known, as the forms.
_JOINS: dict[str, bool] = {}
# The most marks joined to one character, as Unicode's stream-safe text format bounds them (30
# non-starters); the ones after are folded alone. Each mark folds its character again: a run
# of thousands (a model told to write "Zalgo" text) would cost their square.
MAX_JOINED_MARKS = 30


def _joins(char: str) -> bool:
    joins = _JOINS[char] = bool(unicodedata.combining(char)) or "\u1160" <= char <= "\u11ff"
    return joins


def _cluster_form(cluster: str, *, fold_case: bool) -> str:
    """A character and the marks joined to it, as phrases are matched: composed as NFKC
    composes them (its form of each character alone would leave "e" + U+0301 as two)."""
    plain = "".join(c for c in cluster if unicodedata.category(c) != "Cf")
    plain = unicodedata.normalize("NFKC", plain)
    if fold_case:
        plain = unicodedata.normalize("NFKC", plain.casefold())
    return plain


# How deep the groups of a phrases' pattern may nest before it is written as a plain list
# (phrases each a prefix of the next, a thousand deep, would pass what ``re`` compiles).
MAX_PATTERN_DEPTH = 64


def phrases_pattern(phrases: Iterable[str]) -> str:
    """A pattern matching any of ``phrases``, written as their trie (``(?:ab(?:c|d))``): at
    each place in the text the engine follows one branch per character rather than trying
    every phrase in turn, so thousands of phrases cost about what a few do. At a place where
    several match, the longest is taken. Falls back to a plain list of phrases when the trie
    would nest deeper than ``MAX_PATTERN_DEPTH``."""
    trie: dict[str, Any] = {}
    for phrase in phrases:
        node = trie
        for char in phrase:
            node = node.setdefault(char, {})
        node[""] = {}  # a phrase ends here
    try:
        pattern, depth = _trie_pattern(trie)
    except RecursionError:  # phrases each a prefix of the next, past Python's own depth
        pattern, depth = "", MAX_PATTERN_DEPTH + 1
    if depth > MAX_PATTERN_DEPTH:
        longest_first = sorted(phrases, key=len, reverse=True)
        return "|".join(re.escape(phrase) for phrase in longest_first)
    return pattern


def _trie_pattern(node: dict[str, Any]) -> tuple[str, int]:
    """The pattern of the phrases below ``node`` (a longer one first), and how deep its
    groups nest."""
    branches: list[str] = []
    depth = 0
    for char, child in sorted(node.items()):
        if not char:
            continue
        literal = char
        while len(child) == 1 and "" not in child:  # a run of one-way letters: one literal
            [(char, child)] = child.items()
            literal += char
        below, nested = _trie_pattern(child)
        branches.append(re.escape(literal) + below)
        depth = max(depth, nested)
    if not branches:
        return "", 0
    grouped = len(branches) > 1
    body = "(?:" + "|".join(branches) + ")" if grouped else branches[0]
    if "" in node:  # a phrase ends here: the longer ones below are tried first
        return (body if grouped else f"(?:{body})") + "?", depth + 1
    return body, depth + grouped


class BannedPhrases:
    """Fails text containing any of the phrases (case-insensitive unless told otherwise).

    A phrase is found however its letters are written: in a compatibility form (full-width
    letters, ligatures: Unicode's NFKC), and with invisible format characters inside it
    (zero-width spaces and joiners, soft hyphens: category Cf), which a model told to spell a
    phrase past a filter writes; case is folded as Unicode folds it (ß as ss). A letter and
    the combining marks after it are one character, composed as NFKC composes them ("e" +
    U+0301 as "é"), however the phrase or the text writes it. Text of ASCII alone has none of
    these, and is searched as it is."""

    name = "banned_phrase"

    def __init__(self, phrases: Iterable[str], *, case_sensitive: bool = False) -> None:
        self._case_sensitive = case_sensitive
        self.revision = 0
        self._pattern, self.context_chars = self._compiled(phrases)

    def _compiled(self, phrases: Iterable[str]) -> tuple[re.Pattern[str], int]:
        cleaned = sorted({p for p in phrases if p.strip()}, key=len, reverse=True)
        if not cleaned:
            raise ValueError("BannedPhrases needs at least one non-blank phrase")
        folded = {self._fold(p)[0] for p in cleaned}
        flags = 0 if self._case_sensitive else re.IGNORECASE
        # Written with format characters between its letters, a phrase takes more room.
        return re.compile(phrases_pattern(folded), flags), 2 * max(len(p) for p in cleaned)

    def replace(self, phrases: Iterable[str]) -> None:
        """Ban ``phrases`` from now on, and no other, in every reply that reads this check,
        those under way included: their next text is checked against them, the text they
        still hold read again whole (``revision``).

        Raises:
            ValueError: there is no phrase among them (nothing changes).
        """
        self._pattern, self.context_chars = self._compiled(phrases)
        self.revision += 1

    def _fold(self, text: str) -> tuple[str, list[int]]:
        """``text`` as phrases are matched, and where each of its characters came from (the
        start of the character, with any marks joined to it, it is part of)."""
        forms = _CASED_FORMS if self._case_sensitive else _FOLDED_FORMS
        folded: list[str] = []
        origins: list[int] = []
        base = -1  # where the last visible character begins, marks may join it (-1: none)
        made = 0  # how many folded characters it and the marks joined to it made
        for index, char in enumerate(text):
            joins = _JOINS.get(char)
            if joins is None:
                joins = _joins(char)
            if joins and 0 <= base and index - base <= MAX_JOINED_MARKS:
                # A mark joined to the character before it: the two are folded again as one
                # (the character's fold, one piece of ``folded``, replaced).
                if made:
                    folded.pop()
                    del origins[len(origins) - made :]
                cluster = _cluster_form(text[base : index + 1], fold_case=forms is _FOLDED_FORMS)
                made = len(cluster)
                if made:
                    folded.append(cluster)
                    origins.extend([base] * made)
                continue
            plain = forms.get(char)
            if plain is None:
                plain = forms[char] = _form_of(char, fold_case=forms is _FOLDED_FORMS)
            if len(plain) == 1:  # most characters: one folded character
                folded.append(plain)
                origins.append(index)
            elif plain:  # a ligature or a full-width pair unpacked, ß as ss
                folded.append(plain)
                origins.extend([index] * len(plain))
            else:  # invisible: a mark after it joins the character before it
                continue
            if not joins:  # a mark left alone (past the most joined, or first) joins nothing
                base, made = index, len(plain)
        return "".join(folded), origins

    def find(self, text: str, start: int = 0) -> Finding | None:
        if start:  # a phrase looks back at nothing before it
            found = self.find(text[start:])
            if found is None:
                return None
            return replace(found, start=start + found.start, end=start + found.end)
        if text.isascii():  # folds to itself (but for case, which the pattern ignores)
            match = self._pattern.search(text)
            if match is None:
                return None
            return Finding(match.start(), match.end(), self.name, "banned phrase", False)
        folded, origins = self._fold(text)
        match = self._pattern.search(folded)
        if match is None:
            return None
        start, end = origins[match.start()], origins[match.end() - 1] + 1
        while end < len(text) and (
            _JOINS.get(text[end]) or unicodedata.category(text[end]) == "Cf"
        ):
            end += 1  # the marks joined to its last character
        # A phrase found is found whatever comes after it: never tentative.
        return Finding(start, end, self.name, "banned phrase", False)


class RegexCheck:
    """Fails text matching any of the regular expressions (named for reporting).

    A match that reaches the end of the text it was given is tentative: a ``\\b``, a ``$`` or
    a look-ahead there read the end of the text so far as the end of the text. (A look-ahead
    that reads past the end of its match, ``ass(?!istant)``, reads only as far as the text
    so far goes: "ass", "ist" is not tentative, and matches.)"""

    def __init__(
        self,
        patterns: dict[str, str],
        *,
        name: str = "pattern",
        case_insensitive: bool = False,
        context_chars: int = 256,
    ) -> None:
        if not patterns:
            raise ValueError("RegexCheck needs at least one pattern")
        flags = re.IGNORECASE if case_insensitive else 0
        self._patterns = [(label, re.compile(p, flags)) for label, p in patterns.items()]
        self.name = name
        self.context_chars = context_chars
        self.revision = 0  # its patterns are the command line's, for the server's life

    def find(self, text: str, start: int = 0) -> Finding | None:
        found: Finding | None = None
        for label, pattern in self._patterns:
            match = pattern.search(text, start)
            if match is None:
                continue
            at, tentative = match.start(), match.end() == len(text)
            # The earliest; of two at one place, a final one.
            if found is None or at < found.start or (at == found.start and found.tentative):
                found = Finding(at, match.end(), self.name, label, tentative)
        return found


# Shapes of credentials that must never leave in a reply. Anchored on distinctive prefixes so
# ordinary prose does not trip them.
SECRET_PATTERNS = {
    "openai_key": r"\bsk-(?:proj-)?[A-Za-z0-9_-]{20,}",
    "aws_access_key_id": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "github_token": r"\bgh[pousr]_[A-Za-z0-9]{36,}",
    "slack_token": r"\bxox[abprs]-[A-Za-z0-9-]{10,}",
    "private_key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
}


def secret_check() -> RegexCheck:
    return RegexCheck(SECRET_PATTERNS, name="secret")


@dataclass(frozen=True, slots=True)
class Violation:
    """The reply was stopped: which check, and how much had been released before."""

    check: str
    reason: str
    released_chars: int
    released_tokens: int


class HoldBack:
    """Releases text ``window`` tokens late, after every check has seen it in context, and
    never a character that could still begin one of the stop strings."""

    def __init__(self, window: int, checks: Sequence[Check], stops: Sequence[str] = ()) -> None:
        if window < 0:
            raise ValueError("window must be >= 0")
        self.window = window
        self._checks = list(checks)
        self.checks = bool(self._checks)  # held text waits for checks, not only for stops
        self._context = max((c.context_chars for c in self._checks), default=0)
        self._revisions = [c.revision for c in self._checks]  # the rules the text was read by
        self._stops = StopScan(stops) if stops else None
        self._held: deque[tuple[str, int]] = deque()  # (text, tokens), oldest first
        self._held_tokens = 0
        self._held_chars = 0
        self._tail = ""  # the end of released text, as context for checks
        self.released_chars = 0
        self.released_tokens = 0
        self.violation: Violation | None = None
        self.stop_sequence: str | None = None  # the stop string the text ended at
        self._alternatives: dict[str, bool] = {}  # a token's text -> no check matches it
        # The earliest tentative match in the text so far (its place counted from the start
        # of the text), which the next text decides, or the text's end makes final.
        self._pending: Finding | None = None

    @property
    def ended(self) -> bool:
        """A check failed or a stop string completed: nothing more is released."""
        return self.violation is not None or self.stop_sequence is not None

    def push(self, text: str, tokens: int) -> tuple[str, int]:
        """Add newly made text; return what may be released now as (text, tokens).

        When a check fails, this returns the held text before the match (if any) and sets
        ``violation``; when a stop string completes, the held text before it, and sets
        ``stop_sequence``. From then on nothing more is released. A tentative match (see
        ``Finding``) holds back the text from its start on, and fails nothing yet.
        """
        if self.violation is not None or self.stop_sequence is not None:
            return "", 0
        self._held.append((text, tokens))
        self._held_tokens += tokens
        self._held_chars += len(text)
        room = self._held_chars  # how much of the held text is not a stop string's start
        at_match = False  # ``room`` ends where a tentative match begins
        hit: StopHit | None = None
        if self._stops is not None:
            hit = self._stops.feed(text)
            # Every character pushed is released or held, so held text starts where the
            # released text ends.
            end = self._stops.seen - self._stops.keep if hit is None else hit.start
            room = end - self.released_chars
        if self._checks:
            # Text from the stop string on is never shown, so no check reads it.
            first, tentative = self._first_finding(
                self._held_chars - len(text), None if hit is None else room
            )
            if tentative is not None and hit is not None:
                first, tentative = tentative, None  # the text ends at the stop string
            if first is not None:
                cut = first.start if tentative is None else tentative.start
                return self._stop(first, max(0, cut - len(self._tail)))
            if tentative is not None:
                # The text to come decides it: nothing from its start on leaves before then
                # (nothing more, if it began in text already released).
                before_match = max(0, tentative.start - len(self._tail))
                at_match = before_match <= room
                room = min(room, before_match)
                at = self.released_chars - len(self._tail)  # where the tail begins
                tentative = replace(tentative, start=at + tentative.start, end=at + tentative.end)
            self._pending = tentative
        if hit is not None:
            out = self._take(room, lambda: True)
            self._drop_held()
            self.stop_sequence = hit.stop
            return out
        # A token a tentative match begins inside goes out only up to the match, and keeps
        # its count (and so its log probability, whose token holds the match) with the rest.
        return self._take(room, lambda: self._held_tokens > self.window, split_counts=not at_match)

    def _first_finding(self, before: int, end: int | None) -> tuple[Finding | None, Finding | None]:
        """The earliest final match of any check in the released tail and the held text up
        to ``end`` (None: all of it), the text pushed last beginning ``before`` characters
        into the held text, and the earliest tentative match before it (None: none); their
        places counted from the tail's start.

        The earliest match of any check stops the text: the first check to match in list
        order may match after another's, whose text would then be released. Each check reads
        the same context before the new text, of the tail and the held text alike: a match
        it can find (no longer than its context and the new text) that began further back
        it found as the text that ends it came, so the held text before is not read again.
        So a whole reply (every token held) is checked in time linear in its length, not
        quadratic, and a stream's window changes when text is released, not what a check
        finds. The tail keeps one character more than any check reads: every check starts
        after that character and may look back at it, so a pattern's ``\\b`` or ``^`` never
        takes the tail's cut for the start of a word or of the reply (``sk-...`` cut out of
        ``task-...``). A tentative match found last time is read again from its start
        (its text has not been released): the new text decides it, or its length does (one
        longer than ``MAX_TENTATIVE_CHARS`` is final). A check's own final match behind its
        tentative one is found once that one is decided, nothing from its start leaving
        meanwhile: reading on past it at once found a tentative match at every later place
        of a long run (``[A-Za-z0-9]{32,}``), each read to the run's end, a token's work the
        cube of the run's length. Another check's final match behind it stops the text at
        the tentative start.
        """
        tail = len(self._tail)
        end = self._held_chars if end is None else end
        new = tail + min(before, end)  # where the new text begins, from the tail's start
        starts = [max(new - check.context_chars, 0) for check in self._checks]
        revisions = [check.revision for check in self._checks]
        if revisions != self._revisions:
            starts = self._read_again(starts, revisions)
        if self._pending is not None:
            back = max(self._pending.start - (self.released_chars - tail), 0)
            starts = [min(start, back) for start in starts]
        offset = max(min(starts) - 1, 0)  # the text given to the checks begins here
        text = self._tail[offset:] + self._held_text(max(offset - tail, 0), end)
        first: Finding | None = None
        tentative: Finding | None = None
        for check, start in zip(self._checks, starts, strict=True):
            finding = check.find(text, start - offset)
            if finding is not None and finding.tentative:
                if finding.end - finding.start <= MAX_TENTATIVE_CHARS:
                    if tentative is None or finding.start < tentative.start - offset:
                        tentative = replace(
                            finding, start=offset + finding.start, end=offset + finding.end
                        )
                    continue
                finding = replace(finding, tentative=False)
            if finding is not None and (first is None or finding.start < first.start - offset):
                first = replace(finding, start=offset + finding.start, end=offset + finding.end)
        if tentative is not None and first is not None and tentative.start >= first.start:
            tentative = None
        return first, tentative

    def _read_again(self, starts: list[int], revisions: list[int]) -> list[int]:
        """``starts`` with each check whose rules changed since it last read this text (a
        phrase banned while the reply runs) reading all of it once more: every held
        character, which its old rules let through and which has not left, and the
        released tail, so a phrase whose start left before is stopped where it stands. Its
        context from now on is its new one."""
        starts = [
            start if now == seen else 0
            for start, now, seen in zip(starts, revisions, self._revisions, strict=True)
        ]
        self._revisions = revisions
        self._context = max(c.context_chars for c in self._checks)
        self._alternatives.clear()  # read by the old rules
        return starts

    def _held_text(self, begin: int, end: int) -> str:
        """The held text from character ``begin`` to ``end``, read from its newest piece back
        only as far as ``begin`` (a whole reply holds all of its text)."""
        pieces: list[str] = []
        start = self._held_chars  # where the first piece in ``pieces`` begins
        for piece, _ in reversed(self._held):
            if start <= begin:
                break
            start -= len(piece)
            pieces.append(piece)
        pieces.reverse()
        return "".join(pieces)[begin - start : end - start]

    def shown_alternatives(self, made: Sequence[TokenLogprob]) -> tuple[TokenLogprob, ...]:
        """``made`` (released tokens' log probabilities) without the alternatives any check
        matches: a token the model did not choose is text no check read in the reply, and a
        banned word the model weighed (`` Paris`` beside the `` capital`` it chose) would
        reach the reader in ``top_logprobs``. Each alternative is read alone, as text that
        ends there; the part of a phrase one token holds is not a match (as a window shorter
        than a phrase lets its start out)."""
        return tuple(
            entry._replace(top=tuple(t for t in entry.top if self._allows(t.token)))
            for entry in made
        )

    def _allows(self, token: str) -> bool:
        allowed = self._alternatives.get(token)
        if allowed is None:
            allowed = all(check.find(token) is None for check in self._checks)
            if len(self._alternatives) < MAX_ALTERNATIVES_KEPT:
                self._alternatives[token] = allowed
        return allowed

    def finish(self) -> tuple[str, int]:
        """The text ended (the reply did, or a tool call or thinking came): release
        everything still held (it has been checked, and no stop string can complete any
        more). A tentative match is final now that the text ends where it does: as in
        ``push``, this returns the held text before it and sets ``violation``. Text pushed
        after this is new text: a stop string never spans the break; the checks still read
        the released text before it as context."""
        if self.violation is not None or self.stop_sequence is not None:
            return "", 0
        if self._stops is not None:
            self._stops.break_text()
        if self._checks and [c.revision for c in self._checks] != self._revisions:
            # The rules changed since the last text came: the held text is read by the new
            # ones before it leaves. A match at the end is final, the text ending there.
            first, tentative = self._first_finding(self._held_chars, None)
            found = tentative or first  # (a tentative match it returns comes first)
            if found is not None:
                self._pending = None
                return self._stop(found, max(0, found.start - len(self._tail)))
        pending = self._pending
        if pending is not None:
            self._pending = None
            return self._stop(pending, max(0, pending.start - self.released_chars))
        return self._take(self._held_chars, lambda: bool(self._held), to_the_end=True)

    def _stop(self, finding: Finding, safe_chars: int) -> tuple[str, int]:
        # Whole tokens before the match go out; a token the match starts inside goes out only
        # up to the match, and does not count as a released token.
        out = self._take(safe_chars, lambda: True, split_counts=False)
        self._drop_held()
        self.violation = Violation(
            finding.check, finding.reason, self.released_chars, self.released_tokens
        )
        return out

    def _drop_held(self) -> None:
        self._held.clear()
        self._held_tokens = self._held_chars = 0

    def _completed_leaves(self, more: Callable[[], bool]) -> bool:
        """Whether the held pieces with no text at the front (a character's first tokens)
        would leave with the piece that completes their character: that piece is held, and
        ``more()`` still lets it out once they are gone. Alone they would count as released
        tokens whose bytes were never shown."""
        first_tokens = 0
        for text, tokens in self._held:
            if text:
                break
            first_tokens += tokens
        else:
            return False  # the character is not complete yet
        self._held_tokens -= first_tokens
        try:
            return more()
        finally:
            self._held_tokens += first_tokens

    def _take(
        self,
        room: int,
        more: Callable[[], bool],
        *,
        split_counts: bool = True,
        to_the_end: bool = False,
    ) -> tuple[str, int]:
        """Release held pieces, oldest first, while ``more()`` and within ``room``
        characters. A piece that does not fit goes out up to ``room``; its tokens go with
        that first part (``split_counts``), and the rest stays held with none (else with
        them). A piece with
        no text (a token ending inside a character) belongs to the character after it: it
        stays held with that character once ``room`` runs out, or while ``more()`` would
        hold that character back (a window shorter than its tokens), unless the text has
        ended (``to_the_end``), so a stop string or a match beginning with that character
        takes its tokens too."""
        parts: list[str] = []
        released_tokens = 0
        held = self._held
        while held and more():
            text, tokens = held[0]
            if not text and not to_the_end and not (room and self._completed_leaves(more)):
                break
            if len(text) > room:
                if room > 0:
                    parts.append(text[:room])
                    held[0] = (text[room:], 0 if split_counts else tokens)
                    self._held_chars -= room
                    if split_counts:
                        released_tokens += tokens
                        self._held_tokens -= tokens
                break
            held.popleft()
            room -= len(text)
            self._held_tokens -= tokens
            self._held_chars -= len(text)
            parts.append(text)
            released_tokens += tokens
        out = "".join(parts)
        if out or released_tokens:
            self.released_chars += len(out)
            self.released_tokens += released_tokens
            if self._context:
                self._tail = (self._tail + out)[-(self._context + 1) :]
        return out, released_tokens
