/**
 * The status bar item: this server's GPU allocation ("H100-80GB ×1 · vision").
 */
import type { TranslationBundle } from '@jupyterlab/translation';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { getAllocation, IAllocation } from './api';
import { allocationLabel } from './format';

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
 * Shows `GET allocation`'s label, with "· simulated" on a simulated inventory.
 * Loaded once; retried with back-off while the server extension cannot answer.
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
      frequency: { interval: 30 * 1000, backoff: true, max: 10 * 60 * 1000 },
      name: 'gpupool-lab:allocation',
      standby: 'when-hidden'
    });
  }

  /**
   * The allocation, once loaded.
   */
  get allocation(): IAllocation | null {
    return this._allocation;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    super.dispose();
  }

  private async _load(): Promise<void> {
    const trans = this._trans;
    try {
      const allocation = await getAllocation();
      this._allocation = allocation;
      this.node.textContent = allocationLabel(allocation);
      this.node.title = trans.__(
        'This server’s GPU allocation: %1 (click for GPU jobs)',
        allocation.allocation || allocation.label
      );
      this.node.classList.toggle('gpupool-mod-simulated', allocation.simulated);
      this.node.classList.remove('gpupool-mod-error');
      // The allocation is fixed for the server's life: stop asking.
      this._poll.dispose();
    } catch (error) {
      this.node.textContent = trans.__('GPU: unavailable');
      this.node.title = error instanceof Error ? error.message : String(error);
      this.node.classList.add('gpupool-mod-error');
      throw error;
    }
  }

  private _trans: TranslationBundle;
  private _poll: Poll;
  private _allocation: IAllocation | null = null;
}
