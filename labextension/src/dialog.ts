/**
 * The "Run distributed" dialog: GPUs (or MIG instances, or processes) per node, nodes, offer,
 * team, time limit and cells.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import type { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { element } from './dom';

import type { IOffersReply, ITeamOffers, OfferKind } from './api';
import { formatLimit, quotaLine, teamChoiceLabel } from './format';
import {
  baseLabel,
  CellsMode,
  choiceAdmission,
  INotebookCells,
  IRunChoice,
  IRunForm,
  isCounted,
  isOnePerNode,
  lineAdmission,
  MAX_NODES,
  maxPerNode,
  offerEntries,
  offerNames,
  queueNotice,
  validateChoice
} from './validate';

export interface IRunDialogOptions {
  /**
   * The `GET offers` reply: what the user may request now.
   */
  offers: IOffersReply;
  /**
   * The values to start from.
   */
  choice: IRunChoice;
  /**
   * The job's name to start from.
   */
  name: string;
  cells: INotebookCells;
  /**
   * An error to show at first (the server's answer to the previous attempt).
   */
  error?: string | null;
  trans: TranslationBundle;
}

let counter = 0;

/**
 * `perNodeLabel` (validate.ts), translated: what the number per node counts.
 */
function perNodeText(kind: OfferKind, trans: TranslationBundle): string {
  switch (kind) {
    case 'gpu':
      return trans.__('GPUs per node');
    case 'mig':
      return trans.__('MIG instances per node');
    default:
      return trans.__('Processes per node');
  }
}

/**
 * The dialog's body. Inputs are named `name`, `team`, `offer`, `gpus`, `nodes`, `time_limit`
 * (minutes) and `cells` (radio buttons `all`, `upto`, `selected`). Below them,
 * `.gpupool-form-notice` says when the job would queue ("The job will queue: <reason>."; it can
 * still be submitted) and `.gpupool-form-error` why it cannot be submitted (Submit is disabled).
 */
export class RunDistributedBody extends Widget implements Dialog.IBodyWidget<IRunForm> {
  constructor(options: IRunDialogOptions) {
    super();
    this._options = options;
    this._defaultName = options.name;
    this._serverError = options.error ?? null;
    const trans = options.trans;
    const uid = `gpupool-run-${++counter}`;
    this.addClass('gpupool-run-form');

    const field = (label: string, control: HTMLElement, id: string) => {
      const row = element('div', 'gpupool-field');
      const lab = element('label', 'gpupool-field-label', label);
      lab.htmlFor = id;
      control.id = id;
      row.append(lab, control);
      return { row, label: lab };
    };

    const inventory = element('p', 'gpupool-inventory');
    inventory.textContent = trans.__('Pool: %1', options.offers.inventory);
    if (options.offers.simulated) {
      inventory.append(' ', element('span', 'gpupool-simulated', trans.__('simulated')));
    }

    this._name = element('input', 'jp-mod-styled');
    this._name.name = 'name';
    this._name.type = 'text';
    this._name.maxLength = 200;
    this._name.placeholder = options.name;
    this._name.value = options.name;

    this._team = element('select', 'jp-mod-styled');
    this._team.name = 'team';
    for (const t of options.offers.teams) {
      const option = element('option', undefined, teamChoiceLabel(t));
      option.value = t.team;
      this._team.append(option);
    }
    this._quota = element('p', 'gpupool-quota');

    this._offer = element('select', 'jp-mod-styled');
    this._offer.name = 'offer';
    this._offerHint = element('p', 'gpupool-offer-hint');

    this._gpus = element('input', 'jp-mod-styled');
    this._gpus.name = 'gpus';
    this._gpus.type = 'number';
    this._gpus.min = '1';
    this._gpus.step = '1';

    this._nodes = element('input', 'jp-mod-styled');
    this._nodes.name = 'nodes';
    this._nodes.type = 'number';
    this._nodes.min = '1';
    this._nodes.max = String(MAX_NODES);
    this._nodes.step = '1';

    this._time = element('input', 'jp-mod-styled');
    this._time.name = 'time_limit';
    this._time.type = 'number';
    this._time.min = '1';
    this._time.step = '1';
    this._timeHint = element('span', 'gpupool-time-hint');

    const cellsSet = element('fieldset', 'gpupool-cells');
    cellsSet.append(element('legend', undefined, trans.__('Cells')));
    const cellLabels: { [mode in CellsMode]: string } = {
      all: trans.__('All cells (%1)', options.cells.count),
      upto: trans.__('Up to the active cell (cell %1)', options.cells.active + 1),
      selected: trans.__('Selected cells (%1)', options.cells.selected.length)
    };
    for (const mode of ['all', 'upto', 'selected'] as CellsMode[]) {
      const radio = element('input');
      radio.type = 'radio';
      radio.name = 'cells';
      radio.value = mode;
      radio.id = `${uid}-cells-${mode}`;
      if (mode === 'upto' && options.cells.active < 0) {
        radio.disabled = true;
      }
      if (mode === 'selected' && options.cells.selected.length === 0) {
        radio.disabled = true;
      }
      const lab = element('label', 'gpupool-radio');
      lab.htmlFor = radio.id;
      lab.append(radio, ' ', cellLabels[mode]);
      cellsSet.append(lab);
      this._cells.push(radio);
    }

    this._error = element('p', 'gpupool-form-error');
    this._error.setAttribute('role', 'alert');
    this._notice = element('p', 'gpupool-form-notice');
    this._notice.setAttribute('role', 'status');
    this._notice.hidden = true;

    const gpusField = field(trans.__('GPUs per node'), this._gpus, `${uid}-gpus`);
    this._gpusLabel = gpusField.label;
    const timeField = field(trans.__('Time limit (minutes)'), this._time, `${uid}-time_limit`);
    timeField.label.append(' ', this._timeHint);

    const where = element('div', 'gpupool-row');
    where.append(
      field(trans.__('Team'), this._team, `${uid}-team`).row,
      field(trans.__('Offer'), this._offer, `${uid}-offer`).row
    );
    const numbers = element('div', 'gpupool-row');
    numbers.append(
      gpusField.row,
      field(trans.__('Nodes'), this._nodes, `${uid}-nodes`).row,
      timeField.row
    );

    this.node.append(
      inventory,
      field(trans.__('Job name'), this._name, `${uid}-name`).row,
      where,
      this._quota,
      this._offerHint,
      numbers,
      cellsSet,
      this._notice,
      this._error
    );

    const choice = options.choice;
    this._team.value = choice.team;
    if (this._team.selectedIndex < 0 && this._team.options.length > 0) {
      this._team.selectedIndex = 0;
    }
    this._fillOffers(choice.offer);
    this._gpus.value = String(choice.gpus);
    this._nodes.value = String(choice.nodes);
    this._time.value = String(Math.max(1, Math.round(choice.timeLimit / 60)));
    const cellsRadio = this._cells.find(r => r.value === choice.cells && !r.disabled);
    (cellsRadio ?? this._cells[0]).checked = true;
    this._syncOffer();
  }

  /**
   * The form's values (time limit in seconds).
   */
  getValue(): IRunForm {
    const num = (input: HTMLInputElement) =>
      input.value.trim() === '' ? NaN : Number(input.value);
    const checked = this._cells.find(r => r.checked);
    return {
      name: this._name.value.trim() || this._defaultName,
      team: this._team.value,
      offer: this._offer.value,
      gpus: num(this._gpus),
      nodes: num(this._nodes),
      timeLimit: Math.round(num(this._time) * 60),
      cells: (checked?.value ?? '') as CellsMode
    };
  }

  /**
   * Why the form cannot be submitted now, or `null`.
   */
  validate(): string | null {
    const problem = validateChoice(this.getValue(), this._options.offers, this._options.cells);
    if (problem !== null) {
      return problem;
    }
    const invalid = this.node.querySelector<HTMLInputElement>('input:invalid');
    return invalid
      ? invalid.validationMessage || this._options.trans.__('Check the values.')
      : null;
  }

  handleEvent(event: Event): void {
    if (event.target === this._error) {
      return; // our own nudge to the dialog, below
    }
    if (event.target === this._team) {
      this._fillOffers(this._offer.value);
    }
    if (event.target === this._team || event.target === this._offer) {
      this._syncOffer();
    }
    this._serverError = null;
    this._update();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this.node.addEventListener('input', this);
    this.node.addEventListener('change', this);
    this._update();
    // The dialog may start listening after its body is attached: check again once it does.
    requestAnimationFrame(() => this._nudgeDialog());
  }

  protected onBeforeDetach(msg: Message): void {
    this.node.removeEventListener('input', this);
    this.node.removeEventListener('change', this);
    super.onBeforeDetach(msg);
  }

  private get _teamOffers(): ITeamOffers | undefined {
    return this._options.offers.teams.find(t => t.team === this._team.value);
  }

  /**
   * Rebuild the offer options for the chosen team, keeping `keep` selected if it is there.
   */
  private _fillOffers(keep: string): void {
    const trans = this._options.trans;
    this._offer.replaceChildren();
    const team = this._teamOffers;
    if (team === undefined) {
      return;
    }
    this._quota.textContent = quotaLine(team);
    for (const name of offerNames(team)) {
      const entries = offerEntries(team, name);
      const first = entries[0];
      // The offer's best line: one that starts now, else one that would queue, else the first.
      const verdicts = entries.map(e => lineAdmission(e));
      const best =
        verdicts.find(v => v.verdict === 'now') ??
        verdicts.find(v => v.verdict === 'wait') ??
        verdicts[0];
      let text = baseLabel(first);
      if (first.kind !== 'cpu') {
        text = trans.__('%1 — %2 free', text, first.free);
      }
      if (best.verdict === 'wait') {
        text = trans.__('%1 (will queue)', text);
      } else if (best.verdict === 'never') {
        text = trans.__('%1 (%2)', text, best.reason);
      }
      const option = element('option', undefined, text);
      option.value = name;
      option.disabled = best.verdict === 'never';
      option.dataset.admission = best.verdict;
      const why = best.verdict === 'wait' ? trans.__('will queue: %1', best.reason) : best.reason;
      option.title = [first.description, why].filter(Boolean).join(' — ');
      this._offer.append(option);
    }
    this._offer.value = keep;
    if (this._offer.selectedIndex < 0 || this._offer.selectedOptions[0]?.disabled) {
      const firstEnabled = Array.from(this._offer.options).find(o => !o.disabled);
      if (firstEnabled) {
        this._offer.value = firstEnabled.value;
      } else if (this._offer.selectedIndex < 0 && this._offer.options.length > 0) {
        this._offer.selectedIndex = 0;
      }
    }
  }

  /**
   * Fit the number per node and the hint to the chosen offer: a counted offer (whole GPUs, MIG
   * instances) takes up to its largest count, a share exactly one (the input is fixed at 1),
   * CPU any number of processes.
   */
  private _syncOffer(): void {
    const trans = this._options.trans;
    const team = this._teamOffers;
    const entries = team ? offerEntries(team, this._offer.value) : [];
    if (entries.length === 0) {
      this._offerHint.textContent = '';
      this._gpus.disabled = false;
      return;
    }
    const first = entries[0];
    const top = maxPerNode(entries);
    this._gpus.max = String(top);
    this._gpusLabel.textContent = perNodeText(first.kind, trans);
    const onePerNode = isOnePerNode(first.kind);
    this._gpus.disabled = onePerNode;
    if (onePerNode) {
      this._gpus.value = '1';
    }
    const parts = [first.description];
    if (isCounted(first.kind)) {
      const mig = first.kind === 'mig';
      const unit = mig ? trans.__('instances') : trans.__('GPUs');
      const counts = (verdict: string) =>
        entries.filter(e => lineAdmission(e).verdict === verdict).map(e => e.count);
      const now = counts('now');
      const wait = counts('wait');
      if (now.length > 0) {
        parts.push(
          trans.__(
            '%1 free now; up to %2 %3 per node can start now',
            first.free,
            Math.max(...now),
            unit
          )
        );
      } else if (wait.length > 0) {
        parts.push(
          trans.__(
            '%1 free now; up to %2 %3 per node can queue',
            first.free,
            Math.max(...wait),
            unit
          )
        );
      } else {
        parts.push(trans.__('%1 free now', first.free));
      }
      if (mig && top > 1) {
        parts.push(
          trans.__(
            'one rank per instance; several per node talk over gloo (NCCL does not span MIG instances)'
          )
        );
      }
    } else if (onePerNode) {
      parts.push(
        trans.__('%1 free now; one process per node, on its share of one GPU', first.free)
      );
    }
    this._offerHint.textContent = parts.filter(Boolean).join(' · ');
  }

  private _update(): void {
    const seconds = this.getValue().timeLimit;
    this._timeHint.textContent =
      Number.isInteger(seconds) && seconds > 0 ? `= ${formatLimit(seconds)}` : '';
    const problem = this.validate();
    const invalid = problem !== null;
    const notice = invalid
      ? ''
      : queueNotice(choiceAdmission(this.getValue(), this._options.offers));
    this._notice.textContent = notice;
    this._notice.hidden = notice === '';
    this._error.textContent = problem ?? this._serverError ?? '';
    this._error.classList.toggle('jp-mod-error', invalid);
    this._error.classList.toggle('gpupool-mod-server', !invalid && this._serverError !== null);
    if (invalid !== this._invalid) {
      this._invalid = invalid;
      this._nudgeDialog();
    }
  }

  /**
   * Make the dialog re-check its validity (it disables Submit while a `.jp-mod-error` shows).
   */
  private _nudgeDialog(): void {
    if (this.isAttached) {
      this._error.dispatchEvent(new Event('input', { bubbles: true }));
    }
  }

  private _options: IRunDialogOptions;
  private _defaultName: string;
  private _serverError: string | null;
  private _invalid: boolean | null = null;
  private _name: HTMLInputElement;
  private _team: HTMLSelectElement;
  private _quota: HTMLParagraphElement;
  private _offer: HTMLSelectElement;
  private _offerHint: HTMLParagraphElement;
  private _gpus: HTMLInputElement;
  private _gpusLabel: HTMLLabelElement;
  private _nodes: HTMLInputElement;
  private _time: HTMLInputElement;
  private _timeHint: HTMLSpanElement;
  private _cells: HTMLInputElement[] = [];
  private _notice: HTMLParagraphElement;
  private _error: HTMLParagraphElement;
}

/**
 * Show the dialog once; the form when the user pressed Submit, `null` when cancelled.
 */
export async function showRunDialog(options: IRunDialogOptions): Promise<IRunForm | null> {
  const trans = options.trans;
  const body = new RunDistributedBody(options);
  const result = await showDialog<IRunForm>({
    title: trans.__('Run distributed'),
    body,
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: trans.__('Submit') })],
    focusNodeSelector: 'select[name="offer"]'
  });
  if (!result.button.accept || result.value === null) {
    return null;
  }
  return result.value;
}
