// The chat page: a conversation whose replies stream in, and a "wait vs stream" mode that
// sends the same prompt with the same seed to the buffered and the streamed delivery and
// shows both panes growing (or not) with live timers.
//
// Timers start when the request is sent. "First text" is when the answer's first text was
// painted (the animation frame that drew it; a reasoning model's thinking, shown above the
// answer, is not counted), "Total" when the whole reply was on screen.

import {
  ReplyRefused, StreamedReply, bufferedReply, cancelReply, moderatedNote,
} from './reply.js';
import { TextSink } from './render.js';

const $ = (selector) => document.querySelector(selector);
const conversation = $('#conversation');
const composer = $('#composer');
const promptBox = $('#prompt');
const sendButton = $('#send');
const stopButton = $('#stop');
const statusLine = $('#status');
const announcer = $('#announcer');
const settingsForm = $('#settings');
const newChatButton = $('#new-chat');
const intro = $('#intro');

const BADGES = {
  waiting: 'waiting', thinking: 'thinking', streaming: 'streaming', reconnecting: 'reconnecting', done: 'complete',
  stopped: 'stopped', error: 'error', moderated: 'moderated', incomplete: 'incomplete',
  cut: 'cut',
};
const CUT_NOTE = 'Cut at the token limit (max tokens, or the end of the model\'s context).';
// The error codes that say the conversation no longer fits: the engine's context, or the
// server's --max-prompt-chars (prompt_too_long on the native route).
const TOO_LONG = new Set(['context_length_exceeded', 'prompt_too_long']);
// A refused key: the server's words ask for an Authorization header, which a reader of this
// page cannot send; the page sends the key from its settings.
const KEY_NOTE = ' The key goes in Delivery → API key.';
const withKeyNote = (message, code) => (code === 'invalid_api_key' ? message + KEY_NOTE : message);
// The server's keep-alive period, which the page is rendered with (0: it sends none).
const KEEPALIVE_S = Number(document.querySelector('meta[name="keepalive-s"]')?.content) || 0;

function formatMs(ms) {
  if (ms === null) return '—';
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

// Stay at the bottom of the conversation while text grows, unless the reader scrolled up.
let followBottom = true;
addEventListener('scroll', () => {
  followBottom = innerHeight + scrollY >= document.documentElement.scrollHeight - 48;
}, { passive: true });
function keepBottom() {
  if (followBottom) scrollTo({ top: document.documentElement.scrollHeight });
}

/** One reply's view: its text, state badge and timers. */
class Pane {
  #t0 = 0;
  #first = null;
  #total = null;
  #sink;
  #firstTimer;
  #totalTimer;
  #note;
  #tokens;
  #thinking;
  #thought;

  constructor(kind, title) {
    // dir="auto": a reply in a right-to-left script is laid out as one (per paragraph: CSS).
    this.text = element('div', { class: 'reply-text', dir: 'auto' });
    // A reasoning model's thinking (a relayed upstream's): shown open while it comes, folded
    // once the answer starts, and never sent back as the conversation's history.
    this.#thought = element('div', { class: 'thinking-text' });
    this.#thinking = element('details', { class: 'thinking', hidden: '' },
      element('summary', {}, 'Thinking'), this.#thought);
    this.badge = element('span', { class: 'badge' });
    this.#firstTimer = element('strong', { 'data-timer': 'first' }, '—');
    this.#totalTimer = element('strong', { 'data-timer': 'total' }, '—');
    this.#tokens = element('span', { class: 'tokens' });
    this.#note = element('p', { class: 'pane-note', hidden: '' });
    const meta = element('footer', { class: 'pane-meta' },
      element('span', { class: 'metric' }, 'First text ', this.#firstTimer),
      element('span', { class: 'metric' }, 'Total ', this.#totalTimer),
      this.#tokens);
    this.root = element('section', { class: 'pane', 'data-pane': kind });
    if (title) {
      this.root.append(element('header', { class: 'pane-head' }, element('h2', {}, title), this.badge));
    } else {
      meta.prepend(this.badge);  // a chat reply has no title row; its state sits with its timers
    }
    this.root.append(this.#thinking, this.text, this.#note, meta);
    this.#sink = new TextSink(this.text, (at) => this.#painted(at));
  }

  get shownText() { return this.#sink.text; }

  /** The note under the reply (why it ended as it did), or '' when there is none. */
  get note() { return this.#note.hidden ? '' : ` ${this.#note.textContent}`; }

  start() {
    this.#sink.clear();
    this.#thought.textContent = '';
    this.#thinking.hidden = true;
    this.#first = this.#total = null;
    for (const timer of [this.#firstTimer, this.#totalTimer]) timer.removeAttribute('data-ms');
    this.#tokens.textContent = '';
    this.#note.hidden = true;
    this.setState('waiting');
    this.#t0 = performance.now();
    ticker.add(this);
  }

  setState(state) {
    this.root.dataset.state = state;
    this.badge.textContent = BADGES[state] ?? state;
  }

  push(text) { this.#sink.push(text); }

  think(text) {
    if (this.#thinking.hidden) {
      this.#thinking.hidden = false;
      this.#thinking.open = true;
    }
    this.#thought.append(text);
    if (this.root.dataset.state === 'waiting') this.setState('thinking');
    keepBottom();
  }

  gap(lost) {
    const mark = element('span', { class: 'gap', title: `events ${lost.lost_from}–${lost.lost_to}` },
      ' [some text was lost here] ');
    this.#sink.insert(mark);
  }

  finish(result) {
    this.#sink.flush();
    this.#total = performance.now() - this.#t0;
    this.#totalTimer.dataset.ms = this.#total.toFixed(1);
    ticker.delete(this);
    this.tick();
    this.setState(result.state);
    const tokens = result.usage?.completion_tokens;
    if (tokens) this.#tokens.textContent = `${tokens} tokens`;
    if (result.message) {
      this.#note.textContent = result.message;
      this.#note.hidden = false;
    }
  }

  // Live display: a running timer is shown in a muted style until its value is final.
  tick(now = performance.now()) {
    const elapsed = Math.max(0, now - this.#t0);
    this.#firstTimer.textContent = formatMs(this.#first ?? (this.#total ?? elapsed));
    this.#firstTimer.classList.toggle('running', this.#first === null && this.#total === null);
    this.#totalTimer.textContent = formatMs(this.#total ?? elapsed);
    this.#totalTimer.classList.toggle('running', this.#total === null);
  }

  #painted(at) {
    if (this.#first === null) {
      this.#first = Math.max(0, at - this.#t0);
      this.#firstTimer.dataset.ms = this.#first.toFixed(1);
      this.#thinking.open = false;  // the answer has started: its thinking folds away
      if (['waiting', 'thinking'].includes(this.root.dataset.state)) this.setState('streaming');
    }
    keepBottom();
  }
}

// One animation-frame loop updates every running timer, and stops when none is running.
const ticker = {
  panes: new Set(),
  frame: 0,
  add(pane) {
    this.panes.add(pane);
    if (!this.frame) this.frame = requestAnimationFrame((now) => this.tick(now));
  },
  delete(pane) { this.panes.delete(pane); },
  tick(now) {
    this.frame = 0;
    for (const pane of this.panes) pane.tick(now);
    if (this.panes.size) this.frame = requestAnimationFrame((at) => this.tick(at));
  },
};

/** One exchange: the prompt, and its reply in one pane (chat) or two (wait vs stream). */
class Turn {
  constructor(prompt, mode) {
    this.prompt = prompt;
    this.mode = mode;
    this.stream = new Pane('stream', mode === 'compare' ? 'Stream (SSE)' : '');
    this.wait = mode === 'compare' ? new Pane('wait', 'Wait (buffered)') : null;
    this.retryButton = element('button', { type: 'button', class: 'button secondary small' },
      'Retry');
    this.retryButton.hidden = true;
    this.retryButton.addEventListener('click', () => runTurn(this));
    this.seedLabel = element('span', { class: 'seed' });
    const panes = element('div', { class: 'panes' },
      ...(this.wait ? [this.wait.root] : []), this.stream.root);
    this.root = element('article', { class: `turn assistant ${mode}` },
      panes, element('div', { class: 'turn-actions' }, this.seedLabel, this.retryButton));
    this.user = element('article', { class: 'turn user' },
      element('div', { class: 'bubble', dir: 'auto' }, prompt));
    this.active = null;
    this.seed = null;
  }

  get reply() { return this.stream.shownText; }
}

const turns = [];
let running = null;
// The conversation's oldest turn still sent: when the conversation outgrows the model's
// context, the oldest turns are dropped from what is sent (and shown as dropped), never cut.
let contextStart = 0;
let contextNotice = null;

// The delivery settings sent in the request body (numbers; empty means the server's default).
// A value out of the field's range is sent all the same: the server's refusal names it, where
// leaving it out would serve the default without a word.
function settings() {
  const values = {};
  for (const input of settingsForm.elements) {
    if (input.type === 'number' && input.value.trim() !== '') {
      values[input.name] = Number(input.value);
    }
  }
  return values;
}

// The label of a number setting the browser cannot read ("1e400", "--1"): its field then
// reads as empty, and the default would be served without a word.
function unreadableSetting() {
  for (const input of settingsForm.elements) {
    if (input.type === 'number' && input.validity.badInput) {
      return input.closest('label')?.textContent.trim() || input.name;
    }
  }
  return null;
}

const apiKey = () => settingsForm.elements.api_key.value.trim();

// The conversation sent with `upTo`: the turns before it still in the context, each prompt
// with its reply. A prompt that got no reply (refused, failed or stopped before any text) is
// left out: the model never answered it, and one the server refused would be refused again.
function history(upTo) {
  const messages = [];
  for (const turn of turns.slice(contextStart)) {
    if (turn === upTo) break;
    if (!turn.reply) continue;
    messages.push({ role: 'user', content: turn.prompt });
    messages.push({ role: 'assistant', content: turn.reply });
  }
  messages.push({ role: 'user', content: upTo.prompt });
  return messages;
}

function setBusy(busy) {
  sendButton.disabled = busy;
  stopButton.disabled = !busy;
}

// Send the turn once (one pane, or both in compare mode); resolves to whether the server
// refused it because the conversation no longer fits the model's context.
async function exchange(turn) {
  const { seed, ...delivery } = settings();
  // A retry asks for the same generation again: it keeps the turn's first seed.
  turn.seed ??= seed ?? Math.floor(Math.random() * 2 ** 31);
  turn.seedLabel.textContent = `seed ${turn.seed}`;
  const body = { messages: history(turn), seed: turn.seed, ...delivery };

  const key = apiKey();
  const stream = new StreamedReply(body, {
    onText: (text) => turn.stream.push(text),
    onThinking: (text) => turn.stream.think(text),
    onGap: (lost) => turn.stream.gap(lost),
    onStatus: (message) => {
      statusLine.textContent = message;
      if (message) turn.stream.setState('reconnecting');
      else if (turn.stream.root.dataset.state === 'reconnecting') turn.stream.setState('streaming');
    },
  }, { apiKey: key, keepaliveS: KEEPALIVE_S });
  const waitAbort = new AbortController();
  turn.active = { stream, waitAbort, key };

  let tooLong = false;
  const jobs = [];
  turn.stream.start();
  jobs.push(stream.run().then((result) => {
    tooLong ||= TOO_LONG.has(result.code);
    const message = result.state === 'cut' ? CUT_NOTE : withKeyNote(result.message, result.code);
    turn.stream.finish({ ...result, message });
  }));
  if (turn.wait) {
    turn.wait.start();
    jobs.push(bufferedReply(body, { signal: waitAbort.signal, apiKey: key }).then(
      (reply) => {
        if (reply.thinking) turn.wait.think(reply.thinking);
        turn.wait.push(reply.text);
        const moderated = reply.finish_reason === 'moderated';
        const cut = reply.finish_reason === 'length';
        turn.wait.finish({
          state: moderated ? 'moderated' : cut ? 'cut' : 'done',
          usage: reply.usage,
          message: moderated ? moderatedNote(reply.moderation?.reason) : cut ? CUT_NOTE : '',
        });
      },
      (error) => {
        tooLong ||= error instanceof ReplyRefused && TOO_LONG.has(error.code);
        turn.wait.finish(waitAbort.signal.aborted
          ? { state: 'stopped', message: 'Stopped.' }
          : { state: 'error', message: withKeyNote(error.message, error.code) });
      },
    ));
  }
  await Promise.all(jobs);
  turn.active = null;
  return tooLong && !stream.stopped;
}

// Stop sending the oldest turn still sent before `turn`, and say so above the turns still
// sent. False when nothing is left to drop (the newest message alone is too long).
function dropOldest(turn) {
  const index = turns.indexOf(turn);
  if (index < 0 || contextStart >= index) return false;
  setContextStart(contextStart + 1);
  return true;
}

// The oldest turn still sent is turns[start]: those before it are shown as dropped.
function setContextStart(start) {
  turns.forEach((turn, index) => {
    turn.user.classList.toggle('out-of-context', index < start);
    turn.root.classList.toggle('out-of-context', index < start);
  });
  contextStart = start;
  if (!start) {
    contextNotice?.remove();
    contextNotice = null;
    return;
  }
  contextNotice ??= element('p', { class: 'context-notice', role: 'note' });
  const messages = start === 1 ? 'The first exchange' : `The first ${start} exchanges`;
  contextNotice.textContent = `${messages} no longer fit the model's context: they are not `
    + 'sent, so the model no longer sees them.';
  turns[start].user.before(contextNotice);
}

// A screen reader is told a reply once, as it ends, whole, from a region of its own. The
// conversation is not live: its text grows by the frame and its timers tick, each a change a
// reader would be told of piece by piece, which aria-busy does not hold back in every reader.
// (The side-by-side mode's two panes hold the same reply: the streamed one is told.)
// The text as shown, with a gap's marker where text was lost; then the note, if any (why it
// was cut, refused or withheld), which a sighted reader sees under it.
function announce(pane) {
  const state = pane.root.dataset.state;
  announcer.textContent = `Reply ${BADGES[state] ?? state}. ${pane.text.textContent}${pane.note}`;
}

async function runTurn(turn) {
  if (running) return;
  running = turn;
  setBusy(true);
  turn.retryButton.hidden = true;
  // The Send or Retry button just pressed is now disabled or hidden, which would leave the
  // focus nowhere (a keyboard reader starts again from the top): it goes to the message box,
  // where it also returns when the reply ends, and Stop is the next control from there.
  const pressed = document.activeElement;
  if (!pressed || pressed === document.body || [sendButton, turn.retryButton].includes(pressed)) {
    promptBox.focus();
  }
  turn.root.setAttribute('aria-busy', 'true');  // (its text grows and its timers tick)
  announcer.textContent = '';
  const start = contextStart;
  let tooLong = await exchange(turn);
  while (tooLong && running === turn && dropOldest(turn)) tooLong = await exchange(turn);
  // Every earlier turn dropped and still too long: the message alone does not fit, and the
  // turns dropped for it are sent again with the next one.
  if (tooLong && running === turn && contextStart > start) setContextStart(start);
  turn.root.removeAttribute('aria-busy');
  announce(turn.stream);
  const ended = (pane) => ['done', 'cut'].includes(pane.root.dataset.state);
  turn.retryButton.hidden = [turn.stream, turn.wait].every((pane) => !pane || ended(pane));
  if (running === turn) {
    running = null;
    setBusy(false);
  }
  // Back to the message box, unless the reader went elsewhere meanwhile (a setting, say):
  // focus left on the page, or on the composer's buttons, which were disabled under it.
  const at = document.activeElement;
  if (!at || at === document.body || composer.contains(at)) promptBox.focus();
}

function send(prompt) {
  for (const turn of turns) turn.retryButton.remove();  // only the newest reply can be retried
  const mode = document.querySelector('input[name="mode"]:checked').value;
  const turn = new Turn(prompt, mode);
  turns.push(turn);
  intro.remove();
  conversation.append(turn.user, turn.root);
  followBottom = true;
  keepBottom();
  runTurn(turn);
}

// Lone surrogates as U+FFFD (String.prototype.toWellFormed, where the browser has it: before
// 2023 none did, and the text then goes as it is).
function wellFormed(text) {
  return typeof text.toWellFormed === 'function' ? text.toWellFormed() : text;
}

composer.addEventListener('submit', (event) => {
  event.preventDefault();
  if (running) {
    // The message stays in the box, to send once the reply ends (which clears this line).
    statusLine.textContent = 'A reply is still coming: wait for its end, or press Stop, '
      + 'then send this message.';
    return;
  }
  // As written, less trailing blank space: a pasted block keeps its indentation. Half a
  // character (a lone surrogate: text cut inside an emoji) becomes U+FFFD, as shown and as
  // sent: JSON.stringify would send it as an escape the server's JSON parser refuses.
  const prompt = wellFormed(promptBox.value.trimEnd());
  if (!prompt.trim()) {
    statusLine.textContent = 'Nothing to send: the message is empty.';
    return;
  }
  const unreadable = unreadableSetting();
  if (unreadable) {
    statusLine.textContent = `${unreadable}: not a number this browser can read; fix it or `
      + 'clear it for the server\'s default.';
    return;
  }
  statusLine.textContent = '';
  promptBox.value = '';
  fitPrompt();
  send(prompt);
});

// Enter sends, Shift+Enter adds a line; Enter while an input method composes is not a send.
promptBox.addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    composer.requestSubmit();
  }
});

function fitPrompt() {
  promptBox.style.height = 'auto';
  promptBox.style.height = `${Math.min(promptBox.scrollHeight, 200)}px`;
}
promptBox.addEventListener('input', fitPrompt);

function stopRunning() {
  if (!running?.active) return;
  running.active.waitAbort.abort();
  running.active.stream.stop();
}
stopButton.addEventListener('click', stopRunning);

// A new chat stops the reply in progress (cancelled on the server) and forgets every turn.
newChatButton.addEventListener('click', () => {
  stopRunning();
  running = null;
  setBusy(false);
  turns.length = 0;
  contextStart = 0;
  contextNotice = null;
  conversation.replaceChildren(intro);
  statusLine.textContent = '';
  promptBox.value = '';
  fitPrompt();
  promptBox.focus();
});

// A resumable reply keeps generating when its reader leaves; closing the page cancels it
// (a keepalive fetch, unlike sendBeacon, can carry the API key header).
addEventListener('pagehide', () => {
  const id = running?.active?.stream.replyId;
  if (id) cancelReply(id, { apiKey: running.active.key });
});

document.querySelectorAll('input[name="mode"]').forEach((radio) => {
  radio.addEventListener('change', () => { document.body.dataset.mode = radio.value; });
});
document.body.dataset.mode = document.querySelector('input[name="mode"]:checked').value;
promptBox.focus();
