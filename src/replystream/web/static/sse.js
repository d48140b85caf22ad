// Server-sent events parser: decoded text in, events out, exactly as the WHATWG HTML standard
// says (https://html.spec.whatwg.org/multipage/server-sent-events.html). It does no I/O:
// the caller reads the bytes and decodes them with a streaming TextDecoder, which also strips
// a leading BOM and keeps a UTF-8 character split across reads whole.
//
// Chunk edges do not have to match event edges: text is buffered until a line ends, and field
// lines until the blank line that dispatches their event. It behaves like the Python parser
// (replystream.sse.EventParser) on every input; the browser tests compare the two.

export class SSEParser {
  #line = '';         // the line read so far, not yet terminated
  #skipLF = false;    // the last chunk ended in CR: a leading LF is the second half of CRLF
  #data = [];         // data values of the pending event
  #type = '';
  #pending = false;   // a field line was read since the last blank line
  #lastId = '';       // the last event ID buffer
  #dispatchedId = ''; // the last event ID string: the buffer at the last blank line
  #ownId = false;     // the pending event's block has an id field of its own
  #retry = null;
  #closed = false;

  /**
   * The last event ID string: the `id` in force at the last blank line (an `id` field with
   * NUL is ignored). An event cut off before its blank line never counts: resuming after
   * its id would skip it.
   */
  get lastEventId() { return this.#dispatchedId; }

  /** The reconnection time in ms from the last valid `retry` field, or null. */
  get retry() { return this.#retry; }

  /** True while nothing is pending: the text so far ends exactly after an event. */
  get atBoundary() { return this.#line === '' && !this.#pending; }

  /**
   * Parse the next piece of decoded text.
   * @param {string} text
   * @returns {{type: string, data: string, id: string, hasId: boolean}[]} the events it
   *   completes; `id` is the last event ID in force when the event was dispatched ('' if
   *   none), `hasId` whether the event's own block set it (an event without carries the id
   *   of the one before: it is no repeat of that one).
   */
  feed(text) {
    if (this.#closed) throw new Error('feed() on a closed SSEParser');
    if (this.#skipLF && text !== '') {
      this.#skipLF = false;
      if (text[0] === '\n') text = text.slice(1);
    }
    if (text === '') return [];
    // A CR ends its line at once, without waiting for the next chunk to see whether an LF
    // follows; that LF is then dropped as the second half of CRLF.
    this.#skipLF = text.endsWith('\r');
    const lines = (this.#line + text).split(/\r\n|\r|\n/);
    this.#line = lines.pop();
    const events = [];
    for (const line of lines) this.#processLine(line, events);
    return events;
  }

  /** End of stream: an incomplete event is discarded. Returns true if one was. */
  end() {
    const discarded = !this.atBoundary;
    this.#closed = true;
    this.#line = '';
    this.#data = [];
    return discarded;
  }

  #processLine(line, events) {
    if (line === '') {
      if (this.#data.length) {
        events.push({
          type: this.#type || 'message', data: this.#data.join('\n'), id: this.#lastId,
          hasId: this.#ownId,
        });
      }
      this.#data = [];
      this.#type = '';
      this.#ownId = false;
      this.#dispatchedId = this.#lastId;
      this.#pending = false;
      return;
    }
    if (line[0] === ':') return;  // a comment, e.g. a keep-alive
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value[0] === ' ') value = value.slice(1);
    this.#pending = true;
    switch (field) {
      case 'data': this.#data.push(value); break;
      case 'event': this.#type = value; break;
      case 'id':
        if (!value.includes('\0')) {
          this.#lastId = value;
          this.#ownId = true;
        }
        break;
      case 'retry': if (/^[0-9]+$/.test(value)) this.#retry = Number(value); break;
      default: break;  // unknown fields are ignored
    }
  }
}
