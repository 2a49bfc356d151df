/**
 * The GPU jobs panel (left sidebar): the user's jobs, and for the selected one its details,
 * live per-rank logs, cancel and resubmit.
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import type { Message } from '@lumino/messaging';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { element } from './dom';

import { cancelJob, getJob, getLogs, IJob, isFinal, listJobs, resubmitJob } from './api';
import { formatAge, formatLimit, jobDuration, jobResources, utf8Length } from './format';
import { gpuIcon } from './icons';
import { IGpupoolJobs, JOBS_PANEL_ID } from './tokens';

/**
 * Seconds between job list reloads while the panel is visible.
 */
const LIST_INTERVAL = 3000;

/**
 * Seconds between log reads while the selected job runs.
 */
const LOG_INTERVAL = 2000;

/**
 * Reads right after another once the job has ended, to drain its log, before slowing down.
 */
const MAX_DRAINS = 20;

/**
 * The most log text kept in the page (older text is trimmed).
 */
const MAX_LOG_CHARS = 2_000_000;

function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}

/**
 * An ISO time in the browser's locale and time zone.
 */
function localTime(iso: string | null): string {
  if (!iso) {
    return '';
  }
  const t = new Date(iso);
  return Number.isNaN(t.getTime()) ? iso : t.toLocaleString();
}

/**
 * A state as text with the class `gpupool-state-<state>`.
 */
function stateBadge(state: string): HTMLSpanElement {
  const badge = element('span', `gpupool-state gpupool-state-${state}`, state);
  badge.dataset.state = state;
  return badge;
}

export namespace JobsPanel {
  export interface IOptions {
    trans: TranslationBundle;
  }
}

/**
 * The GPU jobs panel.
 */
export class JobsPanel extends Widget implements IGpupoolJobs {
  constructor(options: JobsPanel.IOptions) {
    super();
    this._trans = options.trans;
    const trans = this._trans;
    this.id = JOBS_PANEL_ID;
    this.title.icon = gpuIcon;
    this.title.caption = trans.__('GPU jobs');
    this.addClass('gpupool-jobs-panel');

    const header = element('header', 'gpupool-jobs-header');
    header.append(element('h2', 'gpupool-jobs-title', trans.__('GPU jobs')));
    const reload = element('button', 'jp-Button jp-mod-minimal gpupool-refresh', '⟳');
    reload.type = 'button';
    reload.title = trans.__('Reload the job list');
    reload.setAttribute('aria-label', trans.__('Reload the job list'));
    reload.addEventListener('click', () => void this.refresh().catch(() => undefined));
    header.append(reload);

    this._errorNode = element('p', 'gpupool-jobs-error');
    this._errorNode.setAttribute('role', 'alert');
    this._errorNode.hidden = true;
    this._empty = element(
      'p',
      'gpupool-empty',
      trans.__("No jobs yet. Use Run distributed in a notebook's toolbar.")
    );
    this._empty.hidden = true;
    this._list = element('ul', 'gpupool-job-list');
    this._list.setAttribute('role', 'listbox');
    this._list.setAttribute('aria-label', trans.__('GPU jobs'));
    this._list.addEventListener('click', event => this._onListEvent(event));
    this._list.addEventListener('keydown', event => this._onListEvent(event));

    this._detail = element('section', 'gpupool-job-detail');
    this._detail.hidden = true;
    const detailHeader = element('div', 'gpupool-detail-header');
    this._detailName = element('h3', 'gpupool-detail-name');
    this._detailState = element('span');
    detailHeader.append(this._detailName, this._detailState);
    this._detailInfo = element('dl', 'gpupool-detail-info');

    const actions = element('div', 'gpupool-detail-actions');
    const rankLabel = element('label', 'gpupool-rank-label', trans.__('Rank'));
    this._rank = element('select', 'jp-mod-styled gpupool-rank');
    this._rank.name = 'rank';
    this._rank.id = 'gpupool-rank';
    rankLabel.htmlFor = this._rank.id;
    this._rank.addEventListener('change', () => {
      this._followLog(this._selected, Number(this._rank.value));
    });
    this._cancel = element(
      'button',
      'jp-Button jp-mod-styled jp-mod-warn gpupool-cancel',
      trans.__('Cancel')
    );
    this._cancel.type = 'button';
    this._cancel.addEventListener('click', () => void this._cancelSelected());
    this._resubmit = element(
      'button',
      'jp-Button jp-mod-styled jp-mod-accept gpupool-resubmit',
      trans.__('Resubmit')
    );
    this._resubmit.type = 'button';
    this._resubmit.addEventListener('click', () => void this._resubmitSelected());
    actions.append(rankLabel, this._rank, this._cancel, this._resubmit);

    this._log = element('pre', 'gpupool-log');
    this._log.tabIndex = 0;
    this._log.setAttribute('aria-label', trans.__('Log of the selected rank'));
    this._logStatus = element('p', 'gpupool-log-status');
    this._detail.append(detailHeader, this._detailInfo, actions, this._logStatus, this._log);

    this.node.append(header, this._errorNode, this._empty, this._list, this._detail);

    this._poll = new Poll({
      auto: false,
      factory: () => this.refresh(),
      frequency: { interval: LIST_INTERVAL, backoff: true, max: 60 * 1000 },
      name: 'gpupool-lab:jobs',
      standby: () => (this.isVisible ? 'when-hidden' : true)
    });
    void this._poll.start();
  }

  /**
   * The jobs as last loaded, newest first.
   */
  get jobs(): ReadonlyArray<IJob> {
    return this._jobs;
  }

  /**
   * The selected job's id, or `null`.
   */
  get selected(): string | null {
    return this._selected;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._logGeneration++;
    this._poll.dispose();
    super.dispose();
  }

  /**
   * Reload the job list (throws what the server said, after showing it in the panel).
   */
  async refresh(): Promise<void> {
    try {
      this._jobs = await listJobs();
      this._listError = null;
    } catch (error) {
      this._listError = messageOf(error);
      this._render();
      throw error;
    }
    const selected = this._selected;
    if (selected !== null && !this._jobs.some(j => j.id === selected)) {
      try {
        this._jobs = [await getJob(selected), ...this._jobs];
      } catch {
        this._select(null);
      }
    }
    this._render();
  }

  /**
   * Select a job and reload; the shell reveals the panel (see the plugin).
   */
  async open(jobId?: string): Promise<void> {
    if (jobId !== undefined) {
      this._select(jobId);
    }
    try {
      await this.refresh();
    } catch {
      // shown in the panel
    }
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._poll.refresh();
    this._restartLogIfStalled();
  }

  private _onListEvent(event: Event): void {
    if (event instanceof KeyboardEvent && event.key !== 'Enter' && event.key !== ' ') {
      return;
    }
    const item = (event.target as HTMLElement).closest<HTMLElement>('.gpupool-job');
    const id = item?.dataset.jobId;
    if (id === undefined) {
      return;
    }
    event.preventDefault();
    this._select(id);
    this._render();
  }

  private _select(jobId: string | null): void {
    if (jobId === this._selected) {
      return;
    }
    this._selected = jobId;
    this._renderedRanks = -1;
    this._followLog(jobId, 0);
  }

  private _render(): void {
    const trans = this._trans;
    this._errorNode.textContent = this._listError ?? '';
    this._errorNode.hidden = this._listError === null;
    this._empty.hidden = this._jobs.length > 0 || this._listError !== null;

    const now = Date.now();
    // Items are kept per job and updated in place, so that a click or the keyboard focus is not
    // lost when the list reloads under the pointer.
    const items: HTMLLIElement[] = [];
    for (const job of this._jobs) {
      let li = this._items.get(job.id);
      if (li === undefined) {
        li = element('li', 'gpupool-job');
        li.dataset.jobId = job.id;
        li.tabIndex = 0;
        li.setAttribute('role', 'option');
      }
      const selected = job.id === this._selected;
      li.setAttribute('aria-selected', String(selected));
      li.classList.toggle('jp-mod-selected', selected);
      li.title = job.reason ? `${job.id}: ${job.reason}` : job.id;

      const texts: [string, string][] = [
        ['gpupool-job-gpus', jobResources(job)],
        ['gpupool-job-team', job.team],
        ['gpupool-job-age', formatAge(job.created, now)]
      ];
      const duration = jobDuration(job, now);
      if (duration) {
        texts.push(['gpupool-job-duration', trans.__('ran %1', duration)]);
      }
      if (job.state === 'queued' && job.queue_position !== null) {
        texts.push(['gpupool-job-queue', trans.__('#%1 in queue', job.queue_position)]);
      }
      const signature = JSON.stringify([job.name, job.state, texts]);
      if (li.dataset.signature !== signature) {
        li.dataset.signature = signature;
        const top = element('div', 'gpupool-job-top');
        top.append(element('span', 'gpupool-job-name', job.name || job.id), stateBadge(job.state));
        const bottom = element('div', 'gpupool-job-meta');
        texts.forEach(([className, text], i) => {
          if (i > 0) {
            bottom.append(' · ');
          }
          bottom.append(element('span', className, text));
        });
        li.replaceChildren(top, bottom);
      }
      items.push(li);
    }
    this._items = new Map(items.map(li => [li.dataset.jobId as string, li]));
    const shown = this._list.children;
    if (shown.length !== items.length || items.some((li, i) => shown[i] !== li)) {
      const focused = document.activeElement;
      this._list.replaceChildren(...items);
      if (focused instanceof HTMLElement && items.includes(focused as HTMLLIElement)) {
        focused.focus();
      }
    }
    this._renderDetail(now);
  }

  private _renderDetail(now: number): void {
    const trans = this._trans;
    const job = this._jobs.find(j => j.id === this._selected);
    this._detail.hidden = job === undefined;
    if (job === undefined) {
      return;
    }
    this._detail.dataset.jobId = job.id;
    this._detailName.textContent = job.name || job.id;
    this._detailState.replaceWith((this._detailState = stateBadge(job.state)));

    const rows: [string, string][] = [
      [trans.__('Id'), job.id],
      [trans.__('Team'), job.team],
      [trans.__('Resources'), jobResources(job)],
      [trans.__('Created'), `${localTime(job.created)} (${formatAge(job.created, now)})`]
    ];
    if (job.reason) {
      rows.splice(1, 0, [trans.__('Reason'), job.reason]);
    }
    if (job.queue_position !== null && job.state === 'queued') {
      rows.push([trans.__('Queue position'), String(job.queue_position)]);
    }
    if (job.started) {
      rows.push([trans.__('Started'), localTime(job.started)]);
    }
    if (job.finished) {
      rows.push([trans.__('Finished'), localTime(job.finished)]);
    }
    const duration = jobDuration(job, now);
    if (duration) {
      rows.push([trans.__('Duration'), duration]);
    }
    if (typeof job.time_limit === 'number') {
      rows.push([trans.__('Time limit'), formatLimit(job.time_limit)]);
    }
    if (job.devices.length > 0) {
      rows.push([trans.__('Devices'), job.devices.join(', ')]);
    }
    const codes = Object.entries(job.exit_codes);
    if (codes.length > 0) {
      rows.push([
        trans.__('Exit codes'),
        codes.map(([rank, code]) => trans.__('rank %1: %2', rank, code)).join(', ')
      ]);
    }
    const info: HTMLElement[] = [];
    for (const [key, value] of rows) {
      info.push(element('dt', undefined, key), element('dd', undefined, value));
    }
    this._detailInfo.replaceChildren(...info);

    if (this._renderedRanks !== job.ranks) {
      this._renderedRanks = job.ranks;
      const options: HTMLOptionElement[] = [];
      for (let r = 0; r < Math.max(1, job.ranks); r++) {
        const option = element('option', undefined, trans.__('rank %1', r));
        option.value = String(r);
        options.push(option);
      }
      this._rank.replaceChildren(...options);
      this._rank.value = String(this._logRank);
    }
    const final = isFinal(job.state);
    this._cancel.disabled = final;
    this._resubmit.disabled = !final;
  }

  /**
   * Show one rank's log from the start and follow it while the job runs.
   */
  private _followLog(jobId: string | null, rank: number): void {
    const generation = ++this._logGeneration;
    this._logRank = rank;
    this._logOffset = 0;
    this._logText = '';
    this._log.textContent = '';
    this._logStatus.textContent = '';
    if (jobId !== null) {
      void this._logLoop(jobId, rank, generation);
    }
  }

  private _restartLogIfStalled(): void {
    // The loop keeps itself alive while hidden; nothing to do unless it ended on an error.
    if (this._selected !== null && this._logStalled) {
      this._logStalled = false;
      const generation = ++this._logGeneration;
      void this._logLoop(this._selected, this._logRank, generation);
    }
  }

  private async _logLoop(jobId: string, rank: number, generation: number): Promise<void> {
    const trans = this._trans;
    const current = () => generation === this._logGeneration && !this.isDisposed;
    let failures = 0;
    let drains = 0;
    while (current()) {
      if (!this.isVisible) {
        await sleep(LOG_INTERVAL);
        continue;
      }
      let chunk;
      try {
        chunk = await getLogs(jobId, rank, this._logOffset);
      } catch (error) {
        if (!current()) {
          return;
        }
        failures++;
        this._logStatus.textContent = trans.__('Could not read the log: %1', messageOf(error));
        if (failures >= 5) {
          this._logStalled = true;
          return;
        }
        await sleep(LOG_INTERVAL * failures);
        continue;
      }
      if (!current()) {
        return;
      }
      failures = 0;
      if (!chunk.text && chunk.size < this._logOffset) {
        // The log was started over (a restarted rank): show it from the beginning.
        this._logOffset = 0;
        this._logText = '';
        this._log.textContent = '';
        continue;
      }
      if (chunk.text) {
        this._appendLog(chunk.text);
        // `size` is the offset to read from next (the server holds back a UTF-8 character
        // cut at the end). Never fall behind the bytes already shown, though: a log that grew
        // while the server read it must not show its tail twice.
        const shown = chunk.text.includes('\uFFFD') ? 0 : utf8Length(chunk.text);
        this._logOffset = Math.max(chunk.size, this._logOffset + shown);
      }
      const ended = isFinal(chunk.state);
      if (ended && !chunk.text) {
        this._logStatus.textContent = this._logText
          ? trans.__('Job %1; end of log.', chunk.state)
          : trans.__('Job %1; this rank wrote nothing.', chunk.state);
        return;
      }
      this._logStatus.textContent =
        chunk.state === 'queued'
          ? trans.__('Waiting for the job to start…')
          : trans.__('Following the log (job %1)…', chunk.state);
      if (!ended) {
        drains = 0;
        await sleep(LOG_INTERVAL);
      } else if (++drains > MAX_DRAINS) {
        // The job has ended but the log keeps coming: read on at the normal pace.
        await sleep(LOG_INTERVAL);
      }
    }
  }

  private _appendLog(text: string): void {
    const log = this._log;
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 24;
    this._logText += text;
    if (this._logText.length > MAX_LOG_CHARS) {
      const cut = this._logText.length - MAX_LOG_CHARS;
      this._logText = this._logText.slice(cut);
      log.textContent = this._trans.__('[earlier output not shown]\n') + this._logText;
    } else {
      log.append(text);
    }
    if (atBottom) {
      log.scrollTop = log.scrollHeight;
    }
  }

  private async _cancelSelected(): Promise<void> {
    const trans = this._trans;
    const job = this._jobs.find(j => j.id === this._selected);
    if (job === undefined) {
      return;
    }
    const answer = await showDialog({
      title: trans.__('Cancel job'),
      body: trans.__('Cancel %1 (%2)? Every process of it is stopped.', job.name || job.id, job.id),
      buttons: [
        Dialog.cancelButton({ label: trans.__('Keep it') }),
        Dialog.warnButton({ label: trans.__('Cancel job') })
      ]
    });
    if (!answer.button.accept) {
      return;
    }
    try {
      const cancelled = await cancelJob(job.id);
      this._jobs = this._jobs.map(j => (j.id === cancelled.id ? cancelled : j));
      this._render();
    } catch (error) {
      await showErrorMessage(trans.__('Could not cancel the job'), messageOf(error));
    }
    await this.open();
  }

  private async _resubmitSelected(): Promise<void> {
    const trans = this._trans;
    const id = this._selected;
    if (id === null) {
      return;
    }
    try {
      const job = await resubmitJob(id);
      this._jobs = [job, ...this._jobs.filter(j => j.id !== job.id)];
      await this.open(job.id);
    } catch (error) {
      await showErrorMessage(trans.__('Could not resubmit the job'), messageOf(error));
    }
  }

  private _trans: TranslationBundle;
  private _poll: Poll;
  private _jobs: IJob[] = [];
  private _items = new Map<string, HTMLLIElement>();
  private _listError: string | null = null;
  private _selected: string | null = null;
  private _renderedRanks = -1;
  private _logGeneration = 0;
  private _logRank = 0;
  private _logOffset = 0;
  private _logText = '';
  private _logStalled = false;
  private _errorNode: HTMLParagraphElement;
  private _empty: HTMLParagraphElement;
  private _list: HTMLUListElement;
  private _detail: HTMLElement;
  private _detailName: HTMLHeadingElement;
  private _detailState: HTMLSpanElement;
  private _detailInfo: HTMLDListElement;
  private _rank: HTMLSelectElement;
  private _cancel: HTMLButtonElement;
  private _resubmit: HTMLButtonElement;
  private _log: HTMLPreElement;
  private _logStatus: HTMLParagraphElement;
}
