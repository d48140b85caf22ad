// Reading one reply from POST /v1/replies: streamed (fetch + stream reader + our SSE parser)
// with resume after a dropped connection, or buffered (one JSON body).
//
// Rules this file keeps:
// 1. A reply is complete only with its `done` event (or a buffered 2xx body). A stream that
//    ends without one, cleanly or not, is a dropped connection, never a finished reply.
// 2. A dropped reply that has an id is resumed: GET /v1/replies/{id}/stream with
//    Last-Event-ID, after a capped exponential backoff with jitter (the server's `retry:`
//    sets the base). The prompt is never sent again, and events whose id is not above the
//    last one seen are dropped, so no text is shown twice or skipped.
// 3. Stop cancels the work on the server, not just the local read: a resumable reply keeps
//    generating when its reader leaves, so aborting the fetch is followed by an explicit
//    POST /v1/replies/{id}/cancel.
// 4. A connection that carries no byte for IDLE_KEEPALIVES of the server's keep-alive periods
//    is dropped too: the path lost it without closing it (a phone in a tunnel, a NAT that
//    forgot the flow), and a browser's read would wait for ever; a live stream is never that
//    quiet (replystream.client.resume's idle timeout, the same three periods).
// It must not know about the page: the caller gets text and status through callbacks.

import { SSEParser } from './sse.js';

// Reconnect delays: the base doubles per attempt up to the cap; a `retry:` replaces the base.
export const BACKOFF = { baseMs: 300, maxMs: 8000, attempts: 8 };
// In-band errors about one connection, not the reply (replystream.client.resume's too).
export const RESUMABLE_CUTS = new Set(['slow_client', 'shutdown']);
// Keep-alive periods with no byte after which a connection counts as dropped (rule 4).
export const IDLE_KEEPALIVES = 3;

// What a reply that reached `done` with a gap in it says: its text is not whole.
const LOST_NOTE = 'Part of this reply was lost while reconnecting (marked in the '
  + 'text): the server no longer had it. Retry asks for the whole reply again.';

/** What a reply a moderation check stopped says: the text from the match on was withheld. */
export function moderatedNote(reason) {
  return `Stopped by moderation (${reason || 'a check matched'}): the text from there on was `
    + 'withheld.';
}

/**
 * A reply's ending: state is 'done', 'cut' (it ended at its token limit: `max_tokens` or the
 * model's context, so the answer may be unfinished), 'error', 'moderated', 'incomplete' or
 * 'stopped'.
 */
function ending(state, message = '', extra = {}) {
  return { state, message, ...extra };
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener('abort', () => {
      clearTimeout(timer);
      reject(signal.reason);
    }, { once: true });
  });
}

/** A refused request's words and machine-readable code (ours, or a proxy's bare status). */
export async function refusal(response) {
  let message = '';
  let code = '';
  try {
    const body = await response.json();
    if (typeof body?.error?.message === 'string') {
      message = body.error.message;
      code = body.error.code ?? '';
    }
  } catch { /* not a JSON error body */ }
  if (!message) {
    message = response.status === 401 ? 'The server wants an API key.' : `HTTP ${response.status}`;
  }
  // A 429 or 503 that knows when the server will take a request says so in seconds.
  const wait = (response.headers.get('Retry-After') ?? '').trim();
  if (/^[0-9]+$/.test(wait)) message += ` (try again in ${wait} s)`;
  return { message, code };
}

/**
 * What a request that got no answer at all (a refused connection, a name that does not
 * resolve, the network gone) says: the server could not be reached, not that it refused.
 */
export function unreachable(error) {
  return `The server could not be reached (${error.message}).`;
}


/**
 * Why an API key cannot be sent, or null. A header carries only characters up to U+00FF:
 * given one past it (a zero-width space pasted with the key, say), fetch refuses the request
 * before sending anything, which would read as a server out of reach.
 */
export function unsendableKey(apiKey) {
  const bad = [...apiKey].find((char) => char.codePointAt(0) > 0xff);
  if (bad === undefined) return null;
  const code = bad.codePointAt(0).toString(16).toUpperCase().padStart(4, '0');
  return `The API key has a character a request header cannot carry (U+${code}); `
    + 'nothing was sent. Type the key again without it.';
}

/**
 * Whether a response is an event stream to read, as EventSource decides it: a 200 whose
 * Content-Type is text/event-stream. Any other answer to a resume (a 204, a proxy's HTML
 * page) fails it: read as events it holds none, and asking again brings the same.
 */
function isEventStream(response) {
  const type = (response.headers.get('Content-Type') ?? '').split(';')[0].trim().toLowerCase();
  return response.status === 200 && type === 'text/event-stream';
}

/** Request headers carrying the API key, if the server wants one. */
function authorization(apiKey) {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

/**
 * Ask the server to stop generating reply `id` (only the key that started it may).
 * A server without cancel answers 404, which is fine: nothing is left to stop there.
 */
export async function cancelReply(id, { base = '', apiKey = '' } = {}) {
  try {
    await fetch(`${base}/v1/replies/${encodeURIComponent(id)}/cancel`, {
      method: 'POST',
      headers: authorization(apiKey),
      keepalive: true,  // still sent if the page is closing
    });
  } catch { /* best effort: the connection's close also stops a non-resumable reply */ }
}

/**
 * POST a request body and send it again without `resumable` if the server rejects that field
 * (servers from before resumable replies refuse unknown fields with a 400 naming them).
 */
async function postReply(body, { base = '', apiKey = '', signal } = {}) {
  const headers = {
    'Content-Type': 'application/json',
    Accept: 'text/event-stream, application/json',
    ...authorization(apiKey),
  };
  const send = (payload) => fetch(`${base}/v1/replies`, {
    method: 'POST', headers, body: JSON.stringify(payload), signal,
  });
  let response = await send(body);
  if (response.status === 400 && 'resumable' in body) {
    const error = await response.clone().json().catch(() => null);
    if (error?.error?.param === 'resumable') {
      const { resumable: _ignored, ...rest } = body;
      response = await send(rest);
    }
  }
  return response;
}

/** A refused buffered request: the server's words, and its code (`error.code`). */
export class ReplyRefused extends Error {
  constructor({ message, code }) {
    super(message);
    this.code = code;
  }
}

/**
 * One buffered reply: resolves to {text, finish_reason, usage}; a refusal throws ReplyRefused.
 * Options: signal, base (URL prefix), apiKey.
 */
export async function bufferedReply(body, options = {}) {
  const badKey = unsendableKey(options.apiKey ?? '');
  if (badKey) throw new ReplyRefused({ message: badKey, code: 'invalid_api_key' });
  let response;
  try {
    response = await postReply({ ...body, stream: false }, options);
  } catch (error) {
    if (options.signal?.aborted) throw error;
    throw new Error(unreachable(error));
  }
  if (!response.ok) throw new ReplyRefused(await refusal(response));
  return response.json();
}

/**
 * One streamed reply, resumed across dropped connections.
 *
 * Callbacks (all optional): onText(text, tokens), onThinking(text, tokens) (a reasoning
 * model's thinking, before its answer), onReplyId(id), onStatus(message or ''),
 * onGap({lost_from, lost_to}), onUsage(usage).
 */
export class StreamedReply {
  #body;
  #base;
  #apiKey;
  #on;
  #abort = new AbortController();
  #stopped = false;
  #headers = null;          // settles once the first response's headers are in (or it failed)
  #replyId = null;
  #lastSeq = -Infinity;     // highest numeric event id handled
  #lastId = null;           // the id string to send as Last-Event-ID
  #retryMs = BACKOFF.baseMs;
  #usage = null;
  #gaps = [];               // events the server no longer had when a resume asked for them
  #idleMs;                  // silence that drops a connection (0: never)

  /** Options: base (URL prefix), apiKey, keepaliveS (the server's keep-alive period; 0: none). */
  constructor(body, callbacks = {}, { base = '', apiKey = '', keepaliveS = 0 } = {}) {
    this.#body = { ...body, stream: true, resumable: true };
    this.#base = base;
    this.#apiKey = apiKey;
    this.#on = callbacks;
    this.#idleMs = keepaliveS > 0 ? IDLE_KEEPALIVES * keepaliveS * 1000 : 0;
  }

  get replyId() { return this.#replyId; }

  /** Whether `stop()` was called (the reader, not the server, ended the reply). */
  get stopped() { return this.#stopped; }

  /** Run the reply to its end; resolves to an ending (see `ending`), never rejects. */
  async run() {
    const badKey = unsendableKey(this.#apiKey);
    if (badKey) return ending('error', badKey, { code: 'invalid_api_key' });
    try {
      const post = postReply(this.#body, {
        base: this.#base, apiKey: this.#apiKey, signal: this.#abort.signal,
      });
      this.#headers = post.catch(() => null);
      let response;
      try {
        response = await post;
      } catch (error) {
        if (this.#stopped) throw error;
        return ending('error', unreachable(error));
      }
      if (!response.ok) {
        const { message, code } = await refusal(response);
        return ending('error', message, { code });
      }
      this.#setReplyId(response.headers.get('X-Reply-Id'));
      for (;;) {
        const result = await this.#read(response);
        if (result) return result;
        if (!this.#replyId) {
          return ending('incomplete', 'The connection closed before the reply finished.');
        }
        response = await this.#reconnect();
        if (!isEventStream(response)) {
          return ending('incomplete', await this.#resumeFailure(response));
        }
      }
    } catch (error) {
      if (this.#stopped) return ending('stopped', 'Stopped.');
      return ending('incomplete', `The connection failed: ${error.message}`);
    } finally {
      this.#on.onStatus?.('');
    }
  }

  /** Stop reading and cancel the reply on the server. */
  async stop() {
    if (this.#stopped) return;
    this.#stopped = true;
    // Without an id the reply cannot be cancelled by name; the headers carry it and are sent
    // before the first token, so wait for them briefly rather than abort blind.
    if (!this.#replyId && this.#headers) {
      await Promise.race([this.#headers, sleep(2000)]);
    }
    this.#abort.abort();
    if (this.#replyId) await cancelReply(this.#replyId, { base: this.#base, apiKey: this.#apiKey });
  }

  #setReplyId(id) {
    if (!id || id === this.#replyId) return;
    this.#replyId = id;
    this.#on.onReplyId?.(id);
  }

  // Read one connection's events until a terminal event (returns the ending) or until the
  // connection ends or fails without one (returns null: resume if possible).
  async #read(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();  // one per connection: a new body may start with a BOM
    const parser = new SSEParser();
    try {
      for (;;) {
        const read = await this.#readWithin(reader);
        if (read === null) {  // silent too long: dropped (rule 4)
          reader.cancel().catch(() => {});
          return null;
        }
        const { value, done } = read;
        const text = done ? decoder.decode() : decoder.decode(value, { stream: true });
        const result = this.#handle(parser.feed(text));
        if (parser.retry !== null) this.#retryMs = parser.retry;
        if (result) {
          reader.cancel().catch(() => {});
          return result;
        }
        if (done) return null;
      }
    } catch (error) {
      if (this.#stopped) throw error;
      return null;  // reset, truncated chunked body, network change: all the same to us
    }
  }

  // The next read of the body, or null if nothing came within the idle limit.
  #readWithin(reader) {
    if (!this.#idleMs) return reader.read();
    let timer;
    const silence = new Promise((resolve) => { timer = setTimeout(resolve, this.#idleMs, null); });
    return Promise.race([reader.read(), silence]).finally(() => clearTimeout(timer));
  }

  // Dispatch parsed events; the first terminal one ends the reply.
  #handle(events) {
    for (const event of events) {
      // Reply events are numbered; one without an id of its own (a gap, a notice about this
      // connection) is new whatever id it inherits, and is never skipped as a repeat.
      const seq = event.hasId && event.id !== '' ? Number(event.id) : NaN;
      if (Number.isFinite(seq)) {
        if (seq <= this.#lastSeq) continue;  // already shown before a reconnect
        this.#lastSeq = seq;
      }
      if (event.id !== '') this.#lastId = event.id;
      let data;
      try {
        data = JSON.parse(event.data);
      } catch {
        return ending('error', `The server sent an unreadable ${event.type} event.`);
      }
      switch (event.type) {
        case 'reply': this.#setReplyId(data.reply_id); break;
        case 'token': this.#on.onText?.(data.text, data.tokens); break;
        case 'thinking': this.#on.onThinking?.(data.text, data.tokens); break;
        case 'usage': this.#usage = data; this.#on.onUsage?.(data); break;
        case 'gap': this.#gaps.push(data); this.#on.onGap?.(data); break;
        case 'done': {
          const extra = { finishReason: data.finish_reason, usage: this.#usage };
          // The reply reached its end, but not all of it reached the page: not complete.
          if (this.#gaps.length) return ending('incomplete', LOST_NOTE, extra);
          return ending(data.finish_reason === 'length' ? 'cut' : 'done', '', extra);
        }
        case 'moderated':
          return ending('moderated', moderatedNote(data.reason), { moderation: data });
        case 'error': {
          const { code = 'error', message = 'unknown error' } = data.error ?? {};
          // Cut as a slow reader, or the server going down: about this connection, not the
          // reply, which goes on; the connection ends next, and the reply is resumed.
          if (!event.hasId && RESUMABLE_CUTS.has(code)) break;
          // generator_lost: the server lost the process making this reply; nothing more comes.
          return ending('error', `${message} (${code})`, { code });
        }
        default: break;  // events this page does not know are ignored
      }
    }
    return null;
  }

  // Capped exponential backoff with jitter: half the delay is fixed, half random, so many
  // clients dropped at the same moment do not come back at the same moment.
  #delay(attempt) {
    const capped = Math.min(BACKOFF.maxMs, this.#retryMs * 2 ** (attempt - 1));
    return capped / 2 + Math.random() * (capped / 2);
  }

  // Reconnect to the resume URL until an event stream or an answer that retrying cannot
  // change.
  async #reconnect() {
    const url = `${this.#base}/v1/replies/${encodeURIComponent(this.#replyId)}/stream`;
    let last = null;
    for (let attempt = 1; attempt <= BACKOFF.attempts; attempt++) {
      this.#on.onStatus?.(attempt === 1 ? 'reconnecting…' : `reconnecting… (attempt ${attempt})`);
      await sleep(this.#delay(attempt), this.#abort.signal);
      const headers = { Accept: 'text/event-stream', ...authorization(this.#apiKey) };
      if (this.#lastId !== null) headers['Last-Event-ID'] = this.#lastId;
      try {
        last = await this.#fetchWithin(url, { headers, cache: 'no-store' });
      } catch (error) {
        if (this.#stopped) throw error;
        continue;  // the server is not reachable yet, or did not answer in time
      }
      if (isEventStream(last)) {
        this.#on.onStatus?.('');
        return last;
      }
      if (last.ok || (last.status < 500 && last.status !== 429)) return last;
    }
    if (last) return last;
    throw new Error(`gave up after ${BACKOFF.attempts} attempts to reconnect`);
  }

  // A fetch whose answer must begin within the idle limit: sent on a kept-alive connection
  // the path lost (rule 4), it would wait for ever. Stop aborts it, and its body, too.
  async #fetchWithin(url, options) {
    const attempt = new AbortController();
    const stop = this.#abort.signal;
    stop.addEventListener('abort', () => attempt.abort(stop.reason), { once: true });
    const timer = this.#idleMs
      ? setTimeout(() => attempt.abort(new Error('no answer in time')), this.#idleMs)
      : null;
    try {
      return await fetch(url, { ...options, signal: attempt.signal });
    } finally {
      clearTimeout(timer);
    }
  }

  async #resumeFailure(response) {
    if (response.status === 404) {
      return 'The connection dropped and the server no longer has this reply.';
    }
    if (response.ok) {
      const type = response.headers.get('Content-Type') || 'no Content-Type';
      return 'The connection dropped and resuming failed: the server answered '
        + `HTTP ${response.status} (${type}), not an event stream.`;
    }
    return `The connection dropped and resuming failed: ${(await refusal(response)).message}`;
  }
}
