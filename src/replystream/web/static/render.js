// Drawing streamed text: at most once per animation frame, by appending.
//
// A reply can bring hundreds of events per second; touching the DOM for each one, or
// re-rendering the whole reply each time, makes long replies stutter. Text that arrives
// between two frames is kept in a string and appended to one Text node in the next frame,
// so the cost of a frame is the new text only, however long the reply already is.

export class TextSink {
  #element;
  #node;
  #pending = '';
  #frame = 0;
  #onPaint;
  #text = '';  // text of the nodes before the current one (see insert)
  #queuedAt = 0;  // when the text that asked for the next frame came

  /**
   * @param {HTMLElement} element where the text goes (its current content is kept)
   * @param {(at: number) => void} [onPaint] called after each frame that added text, with
   *   the time it was drawn (performance.now() time base): the frame's timestamp, or when the
   *   text came if that was later (a frame's timestamp is when it began, and a busy page runs
   *   its callbacks late, after text that came since)
   */
  constructor(element, onPaint = () => {}) {
    this.#element = element;
    this.#node = document.createTextNode('');
    element.append(this.#node);
    this.#onPaint = onPaint;
  }

  /** All text drawn so far plus text waiting for the next frame (no inserted elements). */
  get text() { return this.#text + this.#node.data + this.#pending; }

  /** Queue text for the next frame. */
  push(text) {
    if (!text) return;
    this.#pending += text;
    if (!this.#frame) {
      this.#queuedAt = performance.now();
      this.#frame = requestAnimationFrame((at) => this.#paint(Math.max(at, this.#queuedAt)));
    }
  }

  /** Draw whatever is waiting now (at the end of a reply, so the last words are not late). */
  flush() {
    if (this.#frame) cancelAnimationFrame(this.#frame);
    this.#paint(performance.now());
  }

  /** Draw what is waiting, then `mark` (an element such as a gap marker) after it. */
  insert(mark) {
    this.flush();
    this.#text += this.#node.data;
    this.#node = document.createTextNode('');
    this.#element.append(mark, this.#node);
  }

  /** Remove everything this sink drew (a retried reply starts over). */
  clear() {
    if (this.#frame) cancelAnimationFrame(this.#frame);
    this.#frame = 0;
    this.#pending = '';
    this.#text = '';
    this.#element.replaceChildren(this.#node);
    this.#node.data = '';
  }

  #paint(at) {
    this.#frame = 0;
    if (!this.#pending) return;
    this.#node.appendData(this.#pending);
    this.#pending = '';
    this.#onPaint(at);
  }
}
