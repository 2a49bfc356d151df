/**
 * The GPU jobs panel (left sidebar): the user's jobs, and for the selected one its details,
 * live per-rank logs (`joblog.ts`), cancel and resubmit. The texts it shows of a job come from
 * `jobview.ts`. The hub answers the list a page at a time, newest first: the panel shows the
 * first page and, on "Show older jobs", one more each time; every reload reads as many pages as
 * are open.
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import type { Message } from '@lumino/messaging';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { element } from './dom';

import { cancelJob, getJob, IJob, IJobPage, isFinal, listJobs, resubmitJob } from './api';
import { errorMessage } from './format';
import { gpuIcon } from './icons';
import { LogFollower } from './joblog';
import { detailRows, rowParts, stateBadge } from './jobview';
import { IGpupoolJobs, JOBS_PANEL_ID } from './tokens';

/**
 * Milliseconds between job list reloads while the panel is visible.
 */
export const LIST_INTERVAL_MS = 3000;

/**
 * The longest wait between list reloads while they fail (the poll backs off), in milliseconds.
 */
const LIST_RETRY_MAX_MS = 60 * 1000;

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
    this._older = element(
      'button',
      'jp-Button jp-mod-minimal gpupool-older',
      trans.__('Show older jobs')
    );
    this._older.type = 'button';
    this._older.hidden = true;
    this._older.addEventListener('click', () => void this._showOlder());

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
      this._logs.follow(this._selected, Number(this._rank.value));
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

    this._logs = new LogFollower({ trans, isVisible: () => this.isVisible });
    this._detail.append(detailHeader, this._detailInfo, actions, this._logs.status, this._logs.log);

    this.node.append(header, this._errorNode, this._empty, this._list, this._older, this._detail);

    this._poll = new Poll({
      auto: false,
      factory: () => this.refresh(),
      frequency: { interval: LIST_INTERVAL_MS, backoff: true, max: LIST_RETRY_MAX_MS },
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
    this._logs.dispose();
    this._poll.dispose();
    super.dispose();
  }

  /**
   * Reload the job list (throws what the server said, after showing it in the panel).
   */
  async refresh(): Promise<void> {
    try {
      this._jobs = await this._load(this._pages);
      this._listError = null;
    } catch (error) {
      this._listError = errorMessage(error);
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
   * The first `pages` pages of the list (fewer when it ends first), one after another; notes
   * whether more follow.
   */
  private async _load(pages: number): Promise<IJob[]> {
    const jobs: IJob[] = [];
    const seen = new Set<string>();
    let cursor: string | null = null;
    for (let n = 0; n < pages; n++) {
      const page: IJobPage = await listJobs(cursor ?? undefined);
      for (const job of page.jobs) {
        if (!seen.has(job.id)) {
          seen.add(job.id);
          jobs.push(job);
        }
      }
      cursor = page.next;
      if (cursor === null) {
        break;
      }
    }
    this._more = cursor !== null;
    return jobs;
  }

  /**
   * One more page of older jobs (kept open on later reloads).
   */
  private async _showOlder(): Promise<void> {
    this._pages++;
    try {
      await this.refresh();
    } catch {
      this._pages--; // shown in the panel
    }
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
    this._logs.resume();
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
    this._logs.follow(jobId, 0);
  }

  private _render(): void {
    const trans = this._trans;
    this._errorNode.textContent = this._listError ?? '';
    this._errorNode.hidden = this._listError === null;
    this._empty.hidden = this._jobs.length > 0 || this._listError !== null;
    this._older.hidden = !this._more || this._listError !== null;

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

      const texts = rowParts(job, now, trans);
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

    const rows = detailRows(job, now, trans);
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
      this._rank.value = String(this._logs.rank);
    }
    const final = isFinal(job.state);
    this._cancel.disabled = final;
    // Only a submission this server remembers can be sent again (jobs from the command line or
    // from an earlier server cannot): no button for the others.
    this._resubmit.hidden = job.resubmittable !== true;
    this._resubmit.disabled = !final;
    this._resubmit.title = final
      ? trans.__('Submit the same notebook again, with the same resources')
      : trans.__('A job can be resubmitted once it has ended');
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
      await showErrorMessage(trans.__('Could not cancel the job'), errorMessage(error));
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
      await showErrorMessage(trans.__('Could not resubmit the job'), errorMessage(error));
    }
  }

  private _trans: TranslationBundle;
  private _poll: Poll;
  private _jobs: IJob[] = [];
  private _pages = 1;
  private _more = false;
  private _older: HTMLButtonElement;
  private _items = new Map<string, HTMLLIElement>();
  private _listError: string | null = null;
  private _selected: string | null = null;
  private _renderedRanks = -1;
  private _logs: LogFollower;
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
}
