"""A deliberately literal reading of the WHATWG event-stream interpretation, for differential tests.

It takes a whole stream at once and walks it one byte, then one character, at a time, in the
order the standard's text reads, with the standard's own buffers; it is slow on purpose and
shares no code with `replystream.sse.EventParser`, so a test that finds both agree on random
streams has checked the fast parser against the text, not against itself.

- "UTF-8 decode" (Encoding standard): strip one leading BOM (EF BB BF), then run the UTF-8
  decoder with error mode "replacement" (written out below, not Python's codec).
- Lines end at CRLF, a lone LF or a lone CR. Characters after the last line end are not a
  line: at end of file they, and any event without its blank line, are discarded.
- Fields, dispatch and the last event ID follow
  https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation

The one departure, shared with the parser: a ``retry`` value of more digits than Python
converts (``sys.get_int_max_str_digits()``, 4300) is ignored; no reconnection time has that
many digits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

LF = "\n"
CR = "\r"
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Dispatched:
    """One MessageEvent as the standard creates it."""

    type: str
    data: str
    last_event_id: str


@dataclass
class Interpretation:
    """Everything a stream leaves behind once its end of file is reached."""

    events: list[Dispatched] = field(default_factory=list)
    # The "last event ID buffer" (set by every id field) and the event source's "last event
    # ID string" (copied from the buffer when an event is dispatched, data or not).
    last_event_id_buffer: str = ""
    last_event_id_string: str = ""
    reconnection_time: int | None = None
    # End of file found a partial line, or field lines (not comments) without their blank line.
    discarded_incomplete: bool = False


def utf8_decode(stream: bytes) -> str:
    """The Encoding standard's "UTF-8 decode": one BOM stripped, errors replaced."""
    if stream[:3] == b"\xef\xbb\xbf":
        stream = stream[3:]
    return utf8_decoder(stream)


def utf8_decoder(stream: bytes) -> str:
    """The Encoding standard's UTF-8 decoder (section 8.1.1), error mode "replacement"."""
    out: list[str] = []
    code_point = 0
    bytes_seen = 0
    bytes_needed = 0
    lower = 0x80
    upper = 0xBF
    position = 0
    while True:
        if position == len(stream):
            # End of queue: an unfinished sequence is one error.
            if bytes_needed != 0:
                out.append(REPLACEMENT)
            return "".join(out)
        byte = stream[position]
        position += 1
        if bytes_needed == 0:
            if byte <= 0x7F:
                out.append(chr(byte))
            elif 0xC2 <= byte <= 0xDF:
                bytes_needed = 1
                code_point = byte & 0x1F
            elif 0xE0 <= byte <= 0xEF:
                if byte == 0xE0:
                    lower = 0xA0
                if byte == 0xED:
                    upper = 0x9F
                bytes_needed = 2
                code_point = byte & 0xF
            elif 0xF0 <= byte <= 0xF4:
                if byte == 0xF0:
                    lower = 0x90
                if byte == 0xF4:
                    upper = 0x8F
                bytes_needed = 3
                code_point = byte & 0x7
            else:
                out.append(REPLACEMENT)
            continue
        if not lower <= byte <= upper:
            # Reset, emit one error, and read this byte again as the start of a sequence.
            code_point = bytes_needed = bytes_seen = 0
            lower, upper = 0x80, 0xBF
            position -= 1
            out.append(REPLACEMENT)
            continue
        lower, upper = 0x80, 0xBF
        code_point = (code_point << 6) | (byte & 0x3F)
        bytes_seen += 1
        if bytes_seen != bytes_needed:
            continue
        out.append(chr(code_point))
        code_point = bytes_needed = bytes_seen = 0


def lines_of(text: str) -> list[str]:
    """The complete lines of ``text``; whatever follows the last line end is not returned."""
    lines: list[str] = []
    line: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        index += 1
        if char == CR:
            lines.append("".join(line))
            line = []
            if index < len(text) and text[index] == LF:
                index += 1  # CRLF is one line end
        elif char == LF:
            lines.append("".join(line))
            line = []
        else:
            line.append(char)
    return lines


def interpret(stream: bytes) -> Interpretation:
    """Interpret a whole event stream, end of file included."""
    result = Interpretation()
    data_buffer = ""
    event_type_buffer = ""
    text = utf8_decode(stream)
    pending = False
    for line in lines_of(text):
        pending = line != "" and (pending or line[0] != ":")
        if line == "":
            # Dispatch the event.
            result.last_event_id_string = result.last_event_id_buffer
            if data_buffer == "":
                data_buffer = event_type_buffer = ""
                continue
            if data_buffer[-1] == LF:
                data_buffer = data_buffer[:-1]
            event_type = event_type_buffer if event_type_buffer != "" else "message"
            result.events.append(Dispatched(event_type, data_buffer, result.last_event_id_string))
            data_buffer = event_type_buffer = ""
            continue
        if line[0] == ":":
            continue  # a comment
        if ":" in line:
            colon = line.index(":")
            name = line[:colon]
            value = line[colon + 1 :]
            if value[:1] == " ":
                value = value[1:]
        else:
            name, value = line, ""
        if name == "event":
            event_type_buffer = value
        elif name == "data":
            data_buffer += value + LF
        elif name == "id":
            if "\0" not in value:
                result.last_event_id_buffer = value
        elif name == "retry":
            if value != "" and all("0" <= char <= "9" for char in value):
                if len(value) <= sys.get_int_max_str_digits():
                    result.reconnection_time = _base_ten(value)
        # Any other field name is ignored.
    # End of file: pending data (an event without its blank line, a partial line) is discarded.
    result.discarded_incomplete = pending or after_last_line_end(text) != ""
    return result


def after_last_line_end(text: str) -> str:
    """The characters after the last CR or LF: a line not (yet) ended."""
    return text[max(text.rfind(CR), text.rfind(LF)) + 1 :]


def pending_peaks(stream: bytes) -> tuple[int, int]:
    """The largest "data buffer plus line being read", in characters, over complete lines and
    then with the final partial line too: what `EventParser`'s ``max_event_size`` bounds.

    Not part of the standard (which sets no limit); measured here on the standard's lines.
    """
    text = utf8_decode(stream)
    data_size = peak = 0
    for line in lines_of(text):
        peak = max(peak, data_size + len(line))
        if line == "":
            data_size = 0
        elif line.startswith("data:") or line == "data":
            value = line[5:]
            data_size += len(value[1:] if value[:1] == " " else value) + 1  # value and its LF
    return peak, max(peak, data_size + len(after_last_line_end(text)))


def _base_ten(digits: str) -> int:
    number = 0
    for char in digits:
        number = number * 10 + (ord(char) - ord("0"))
    return number
