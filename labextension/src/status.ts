/**
 * The status bar item: this server's GPU allocation ("H100-80GB ×1 · vision"), and the hub's
 * warning while its idle GPUs are about to be reclaimed ("GPU idle · stops 14:05").
 */
import { Notification } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { getAllocation, IAllocation, IReclaimWarning } from './api';
import { allocationLabel, reclaimLabel } from './format';

/**
 * How often the allocation is asked for again (the idle warning comes and goes), in ms.
 */
export const ALLOCATION_REFRESH_INTERVAL = 60 * 1000;

/**
 * The longest wait between tries while the server extension cannot answer, in ms.
 */
const ALLOCATION_RETRY_MAX = 10 * 60 * 1000;

export namespace AllocationStatus {
  export interface IOptions {
    trans: TranslationBundle;
    /**
     * Called on click (opens the GPU jobs panel).
     */
    onClick?: () => void;
  }
}

/**
 * Shows `GET allocation`'s label, with "· simulated" on a simulated inventory; while the hub
 * warns that the idle GPUs will be reclaimed, a warning state with the time and the hub's
 * message as the tooltip, and one notification per warning (per `reclaim_at`).
 *
 * Asked again every {@link ALLOCATION_REFRESH_INTERVAL} ms while the page is visible (with
 * back-off while the server extension cannot answer), until disposed.
 */
export class AllocationStatus extends Widget {
  constructor(options: AllocationStatus.IOptions) {
    super({ node: document.createElement('div') });
    this._trans = options.trans;
    this.addClass('jp-StatusBar-TextItem');
    this.addClass('gpupool-status');
    this.node.setAttribute('role', 'status');
    this.node.textContent = this._trans.__('GPU: …');
    this.node.title = this._trans.__('Loading this server’s GPU allocation');
    const onClick = options.onClick;
    if (onClick) {
      this.addClass('gpupool-mod-clickable');
      this.node.addEventListener('click', () => onClick());
    }
    this._poll = new Poll({
      factory: () => this._load(),
      frequency: {
        interval: ALLOCATION_REFRESH_INTERVAL,
        backoff: true,
        max: ALLOCATION_RETRY_MAX
      },
      name: 'gpupool-lab:allocation',
      standby: 'when-hidden'
    });
  }

  /**
   * The allocation, once loaded (the latest answer).
   */
  get allocation(): IAllocation | null {
    return this._allocation;
  }

  /**
   * The hub's idle warning for this server, while there is one.
   */
  get warning(): IReclaimWarning | null {
    return this._allocation?.warning ?? null;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    super.dispose();
  }

  private async _load(): Promise<void> {
    let allocation: IAllocation;
    try {
      allocation = await getAllocation();
    } catch (error) {
      if (this._allocation === null) {
        this.node.textContent = this._trans.__('GPU: unavailable');
        this.node.title = error instanceof Error ? error.message : String(error);
        this.node.classList.add('gpupool-mod-error');
      }
      // Once loaded, what was shown stays (a warning included) while the poll backs off.
      throw error;
    }
    if (this.isDisposed) {
      return;
    }
    this._allocation = allocation;
    this._render(allocation);
    this._notify(allocation.warning ?? null);
  }

  private _render(allocation: IAllocation): void {
    const trans = this._trans;
    const warning = allocation.warning ?? null;
    if (warning) {
      this.node.textContent = reclaimLabel(warning);
      this.node.title = warning.message;
    } else {
      this.node.textContent = allocationLabel(allocation);
      this.node.title = trans.__(
        'This server’s GPU allocation: %1 (click for GPU jobs)',
        allocation.allocation || allocation.label
      );
    }
    this.node.classList.toggle('gpupool-mod-warning', warning !== null);
    this.node.classList.toggle('gpupool-mod-simulated', allocation.simulated);
    this.node.classList.remove('gpupool-mod-error');
  }

  /**
   * One notification per warning (per distinct `reclaim_at`); the one shown is dismissed once
   * it no longer holds (the GPU was used again, or a later warning replaced it).
   */
  private _notify(warning: IReclaimWarning | null): void {
    const reclaimAt = warning?.reclaim_at ?? null;
    if (this._shown && this._shown.reclaimAt !== reclaimAt) {
      Notification.dismiss(this._shown.id);
      this._shown = null;
    }
    if (warning && reclaimAt !== null && !this._notified.has(reclaimAt)) {
      this._notified.add(reclaimAt);
      const id = Notification.warning(warning.message, { autoClose: false });
      this._shown = { id, reclaimAt };
    }
  }

  private _trans: TranslationBundle;
  private _poll: Poll;
  private _allocation: IAllocation | null = null;
  private _notified = new Set<string>();
  private _shown: { id: string; reclaimAt: string } | null = null;
}
