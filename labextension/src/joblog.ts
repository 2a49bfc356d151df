/**
 * The log follower of the GPU jobs panel: one rank's log of one job, read from the byte offset
 * the server gives and appended while the job runs, then drained once it has ended.
 */
import type { TranslationBundle } from '@jupyterlab/translation';
import type { IDisposable } from '@lumino/disposable';

import { element } from './dom';

import { getLogs, isFinal } from './api';
import { errorMessage, utf8Length } from './format';

/**
 * Milliseconds between log reads while the job runs (and between checks while hidden).
 */
export const LOG_INTERVAL_MS = 2000;

/**
 * Reads right after another once the job has ended, to drain its log, before slowing down.
 */
const MAX_DRAINS = 20;

/**
 * Failed reads in a row after which the follower stops (until `resume`).
 */
const MAX_FAILURES = 5;

/**
 * The most log text kept in the page, in characters (older text is trimmed).
 */
export const MAX_LOG_CHARS = 2_000_000;

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}

export namespace LogFollower {
  export interface IOptions {
    trans: TranslationBundle;
    /**
     * Whether the log is on screen; while it is not, the follower checks again every
     * {@link LOG_INTERVAL_MS} without reading.
     */
    isVisible: () => boolean;
  }
}

/**
 * Shows one rank's log in {@link log} and what the follower is doing in {@link status}.
 *
 * One read loop at a time: `follow` starts a new one and the previous one ends at its next
 * step (each loop carries a generation number).
 */
export class LogFollower implements IDisposable {
  constructor(options: LogFollower.IOptions) {
    this._trans = options.trans;
    this._isVisible = options.isVisible;
    this.log = element('pre', 'gpupool-log');
    this.log.tabIndex = 0;
    this.log.setAttribute('aria-label', this._trans.__('Log of the selected rank'));
    this.status = element('p', 'gpupool-log-status');
  }

  /**
   * The log text (a `pre`).
   */
  readonly log: HTMLPreElement;

  /**
   * What the follower is doing, or why it stopped.
   */
  readonly status: HTMLParagraphElement;

  /**
   * The rank followed (or last followed).
   */
  get rank(): number {
    return this._rank;
  }

  /**
   * The job followed, or `null`.
   */
  get jobId(): string | null {
    return this._jobId;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  dispose(): void {
    this._disposed = true;
    this._generation++;
  }

  /**
   * Show one rank's log of a job from the start and follow it while the job runs
   * (`null`: show nothing).
   */
  follow(jobId: string | null, rank: number): void {
    const generation = ++this._generation;
    this._jobId = jobId;
    this._rank = rank;
    this._offset = 0;
    this._text = '';
    this._stalled = false;
    this.log.textContent = '';
    this.status.textContent = '';
    if (jobId !== null) {
      void this._loop(jobId, rank, generation);
    }
  }

  /**
   * Read on where the follower stopped after repeated failures (nothing to do otherwise: the
   * loop keeps itself alive while hidden).
   */
  resume(): void {
    if (this._jobId !== null && this._stalled && !this._disposed) {
      this._stalled = false;
      void this._loop(this._jobId, this._rank, ++this._generation);
    }
  }

  private async _loop(jobId: string, rank: number, generation: number): Promise<void> {
    const trans = this._trans;
    const current = () => generation === this._generation && !this._disposed;
    let failures = 0;
    let drains = 0;
    while (current()) {
      if (!this._isVisible()) {
        await sleep(LOG_INTERVAL_MS);
        continue;
      }
      let chunk;
      try {
        chunk = await getLogs(jobId, rank, this._offset);
      } catch (error) {
        if (!current()) {
          return;
        }
        failures++;
        this.status.textContent = trans.__('Could not read the log: %1', errorMessage(error));
        if (failures >= MAX_FAILURES) {
          this._stalled = true;
          return;
        }
        await sleep(LOG_INTERVAL_MS * failures);
        continue;
      }
      if (!current()) {
        return;
      }
      failures = 0;
      if (!chunk.text && chunk.size < this._offset) {
        // The log was started over (a restarted rank): show it from the beginning.
        this._offset = 0;
        this._text = '';
        this.log.textContent = '';
        continue;
      }
      if (chunk.text) {
        this._append(chunk.text);
        // `size` is the byte offset to read from next (the server holds back a UTF-8
        // character cut at the end). Never fall behind the bytes already shown, though: a log
        // that grew while the server read it must not show its tail twice.
        const shown = chunk.text.includes('\uFFFD') ? 0 : utf8Length(chunk.text);
        this._offset = Math.max(chunk.size, this._offset + shown);
      }
      const ended = isFinal(chunk.state);
      if (ended && !chunk.text) {
        this.status.textContent = this._text
          ? trans.__('Job %1; end of log.', chunk.state)
          : trans.__('Job %1; this rank wrote nothing.', chunk.state);
        return;
      }
      this.status.textContent =
        chunk.state === 'queued'
          ? trans.__('Waiting for the job to start…')
          : trans.__('Following the log (job %1)…', chunk.state);
      if (!ended) {
        drains = 0;
        await sleep(LOG_INTERVAL_MS);
      } else if (++drains > MAX_DRAINS) {
        // The job has ended but the log keeps coming: read on at the normal pace.
        await sleep(LOG_INTERVAL_MS);
      }
    }
  }

  private _append(text: string): void {
    const log = this.log;
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 24;
    this._text += text;
    if (this._text.length > MAX_LOG_CHARS) {
      this._text = this._text.slice(this._text.length - MAX_LOG_CHARS);
      log.textContent = this._trans.__('[earlier output not shown]\n') + this._text;
    } else {
      log.append(text);
    }
    if (atBottom) {
      log.scrollTop = log.scrollHeight;
    }
  }

  private _trans: TranslationBundle;
  private _isVisible: () => boolean;
  private _disposed = false;
  private _generation = 0;
  private _jobId: string | null = null;
  private _rank = 0;
  private _offset = 0;
  private _text = '';
  private _stalled = false;
}
