// The EventSource page: the browser's built-in reader on the resume URL, to show its own
// reconnect with Last-Event-ID. EventSource only makes GET requests, so the reply is started
// with a POST whose body we never read: we take the id from the X-Reply-Id header and abort.
// A resumable reply keeps generating when its first reader leaves, so nothing is lost.

import { TextSink } from './render.js';
import {
  BACKOFF, RESUMABLE_CUTS, cancelReply, moderatedNote, refusal, unreachable, unsendableKey,
} from './reply.js';

const $ = (selector) => document.querySelector(selector);
const pane = $('#pane');
const sink = new TextSink($('#text'));
let source = null;
let opens = 0;
// Connections that failed since the last one opened: EventSource retries for ever while the
// server cannot be reached, so the page gives up after as many as the chat page tries.
let failures = 0;
let lastSeq = -Infinity;
let gapsSeen = new Set();  // a gap has no id of its own: it is known by the events it names
// The reply being read, until the server ends it: leaving the page cancels it there.
let current = null;

function setState(state, label = state) {
  pane.dataset.state = state;
  $('#badge').textContent = label;
}

function log(message) {
  const stamp = new Date().toISOString().slice(11, 23);
  $('#log').append(Object.assign(document.createElement('li'), { textContent: `${stamp}  ${message}` }));
}

function finish(state, label, message) {
  source?.close();  // without this, EventSource would reconnect even after a normal end
  // An incomplete reply may still be generating (the page's reading failed, not the reply;
  // and a page being left closes its source before its pagehide): it stays cancellable.
  if (state !== 'incomplete') current = null;
  sink.flush();
  setState(state, label);
  // Told once, whole, as it ends: the text itself is not live, or a screen reader would be
  // told each frame's piece of it. The text as shown (a gap's marker where text was lost),
  // and why a reply that is not complete ended, which the log shows a sighted reader.
  const why = state === 'done' ? '' : ` ${message}`;
  $('#announcer').textContent = `Reply ${label}. ${$('#text').textContent}${why}`;
  log(message);
  $('#go').disabled = false;
}

async function startReply(prompt, apiKey) {
  const badKey = unsendableKey(apiKey);
  if (badKey) throw new Error(badKey);
  const abort = new AbortController();
  let response;
  try {
    response = await fetch('/v1/replies', {
      method: 'POST',
      headers: {
        'Content-Type': 'application/json',
        ...(apiKey ? { Authorization: `Bearer ${apiKey}` } : {}),
      },
      // A user's message, as the chat page sends it: a bare `prompt` is text for the model
      // to continue, and an instruction-tuned model may just end it.
      body: JSON.stringify({ messages: [{ role: 'user', content: prompt }], resumable: true }),
      signal: abort.signal,
    });
  } catch (error) {
    throw new Error(unreachable(error));
  }
  const id = response.headers.get('X-Reply-Id');
  if (!response.ok) {
    // A refusal's body is its reason (a wrong key, a rate limit, a bad setting): said as is.
    const { message } = await refusal(response);
    const status = `HTTP ${response.status}`;
    throw new Error(message.startsWith(status) ? message : `${message} (${status})`);
  }
  abort.abort();  // we only wanted the id; the reply keeps generating for its next reader
  if (!id) throw new Error('this server does not offer resumable replies (no X-Reply-Id)');
  return id;
}

function follow(id, apiKey) {
  current = { id, apiKey };
  // EventSource cannot send headers, so the resume route also takes the key in the query.
  const query = apiKey ? `?api_key=${encodeURIComponent(apiKey)}` : '';
  source = new EventSource(`/v1/replies/${encodeURIComponent(id)}/stream${query}`);
  source.addEventListener('open', () => {
    failures = 0;
    opens += 1;
    $('#opens').textContent = String(opens);
    setState('streaming', 'streaming');
    log(opens === 1 ? 'connected' : `reconnected (Last-Event-ID: ${$('#last-id').textContent})`);
  });
  const handlers = {
    token: (data) => sink.push(data.text),
    gap: (data) => {
      const lost = `${data.lost_from}–${data.lost_to}`;
      if (gapsSeen.has(lost)) return;
      gapsSeen.add(lost);
      sink.insert(Object.assign(document.createElement('span'), {
        className: 'gap', title: `events ${lost}`, textContent: ' [some text was lost here] ',
      }));
      log(`the server lost events ${lost}`);
    },
    done: (data) => {
      // The reply reached its end, but not all of it reached the page: not complete.
      if (gapsSeen.size) {
        finish('incomplete', 'incomplete', `done (${data.finish_reason}), but events `
          + `${[...gapsSeen].join(', ')} were lost on the way; source closed`);
        current = null;  // nothing is left generating to cancel
        return;
      }
      // A reply cut at its token limit is whole as far as it went, but not complete.
      if (data.finish_reason === 'length') {
        finish('cut', 'cut', 'cut at the token limit (length); source closed');
      } else {
        finish('done', 'complete', `done (${data.finish_reason}); source closed`);
      }
    },
    moderated: (data) => finish('moderated', 'moderated', moderatedNote(data.reason)),
  };
  for (const [type, handle] of Object.entries(handlers)) {
    source.addEventListener(type, (event) => {
      // Replayed events the page already has are skipped; ids are sequence numbers. A gap
      // carries the id of the event before it (EventSource tells no event's own id apart).
      const seq = Number(event.lastEventId);
      if (type !== 'gap' && Number.isFinite(seq) && event.lastEventId !== '') {
        if (seq <= lastSeq) return;
        lastSeq = seq;
        $('#last-id').textContent = event.lastEventId;
      }
      handle(JSON.parse(event.data));
    });
  }
  // Two different things arrive as "error": the server's `event: error` (a MessageEvent with
  // data) ends the reply; a plain Event is the connection failing, which EventSource retries
  // by itself unless it gave up (readyState CLOSED, e.g. after a 404).
  source.addEventListener('error', (event) => {
    if (event instanceof MessageEvent) {
      const { message = 'unknown error', code = 'error' } = JSON.parse(event.data).error ?? {};
      if (RESUMABLE_CUTS.has(code)) {
        // About this connection: the server closes it, and EventSource reconnects.
        log(`the server cut this connection (${code}); EventSource reconnects by itself`);
        return;
      }
      finish('error', 'error', `server error (${code}): ${message}`);
    } else if (source.readyState === EventSource.CLOSED) {
      finish('incomplete', 'incomplete', 'the browser gave up on the connection');
    } else if (++failures > BACKOFF.attempts) {
      finish('incomplete', 'incomplete',
        `the server could not be reached in ${BACKOFF.attempts} attempts to reconnect; `
        + 'source closed');
    } else {
      setState('reconnecting', 'reconnecting');
      log('connection lost; EventSource reconnects by itself');
    }
  });
}

$('#start').addEventListener('submit', async (event) => {
  event.preventDefault();
  source?.close();
  sink.clear();
  $('#announcer').textContent = '';
  $('#log').replaceChildren();
  opens = 0;
  failures = 0;
  lastSeq = -Infinity;
  gapsSeen = new Set();
  $('#opens').textContent = '0';
  $('#last-id').textContent = '—';
  $('#go').disabled = true;
  setState('waiting', 'starting');
  try {
    const apiKey = $('#api-key').value.trim();
    // Half a character (a lone surrogate) as U+FFFD, as the chat page sends it.
    const prompt = $('#prompt').value;
    const id = await startReply(
      typeof prompt.toWellFormed === 'function' ? prompt.toWellFormed() : prompt, apiKey);
    $('#reply-id').textContent = id;
    log(`reply ${id} started; its POST was aborted after the headers`);
    follow(id, apiKey);
  } catch (error) {
    finish('error', 'error', error.message);
  }
});

// A resumable reply keeps generating when its reader leaves (for the server's detach grace);
// leaving the page cancels it, as the chat page does (a keepalive fetch carries the key).
addEventListener('pagehide', () => {
  if (current) cancelReply(current.id, { apiKey: current.apiKey });
});
