/**
 * The "Run distributed" flow: offers → dialog (pre-filled with the last choice) → validation →
 * save the notebook → submit → show the job. Loaded on first use.
 */
import { Notification, showErrorMessage } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { IStateDB } from '@jupyterlab/statedb';
import type { TranslationBundle } from '@jupyterlab/translation';

import { getOffers, IJob, IOffersReply, submitJob } from './api';
import { showRunDialog } from './dialog';
import { errorMessage } from './format';
import { LAST_CHOICE_KEY } from './tokens';
import {
  INotebookCells,
  initialChoice,
  IRunChoice,
  parseChoice,
  submission,
  validateChoice
} from './validate';

/**
 * Where the last choice is remembered: the state database, or localStorage without one.
 */
export class ChoiceStore {
  constructor(private _state: IStateDB | null) {}

  async load(): Promise<Partial<IRunChoice> | null> {
    try {
      if (this._state) {
        return parseChoice(await this._state.fetch(LAST_CHOICE_KEY));
      }
      const raw = window.localStorage.getItem(LAST_CHOICE_KEY);
      return raw ? parseChoice(JSON.parse(raw)) : null;
    } catch {
      return null;
    }
  }

  async save(choice: IRunChoice): Promise<void> {
    const value = {
      team: choice.team,
      offer: choice.offer,
      gpus: choice.gpus,
      nodes: choice.nodes,
      timeLimit: choice.timeLimit,
      cells: choice.cells
    };
    try {
      if (this._state) {
        await this._state.save(LAST_CHOICE_KEY, value);
      } else {
        window.localStorage.setItem(LAST_CHOICE_KEY, JSON.stringify(value));
      }
    } catch {
      // Remembering is a convenience; never fail a submission over it.
    }
  }
}

/**
 * The notebook's cells now: how many, the active one and the selected ones.
 */
export function notebookCells(panel: NotebookPanel): INotebookCells {
  const notebook = panel.content;
  const selected: number[] = [];
  notebook.widgets.forEach((cell, index) => {
    if (notebook.isSelectedOrActive(cell)) {
      selected.push(index);
    }
  });
  return { count: notebook.widgets.length, active: notebook.activeCellIndex, selected };
}

/**
 * The default job name: the notebook's file name without `.ipynb`.
 */
export function notebookName(path: string): string {
  const base = path.split('/').pop() ?? path;
  return base.replace(/\.ipynb$/i, '') || 'notebook';
}

export interface IRunOptions {
  panel: NotebookPanel;
  state: IStateDB | null;
  trans: TranslationBundle;
  /**
   * Reveal a submitted job (in the GPU jobs panel).
   */
  show: (job: IJob) => Promise<void>;
}

/**
 * Ask, submit and show; the job, or `null` when the user cancelled or nothing can be asked.
 */
export async function runDistributed(options: IRunOptions): Promise<IJob | null> {
  const { panel, trans } = options;
  const store = new ChoiceStore(options.state);
  let offers: IOffersReply;
  try {
    offers = await getOffers();
  } catch (error) {
    await showErrorMessage(trans.__('Cannot run distributed'), errorMessage(error));
    return null;
  }
  const cells = notebookCells(panel);
  let name = notebookName(panel.context.path);
  let choice = initialChoice(offers, await store.load());
  let error: string | null = null;

  for (;;) {
    const form = await showRunDialog({ offers, choice, name, cells, error, trans });
    if (form === null) {
      return null;
    }
    choice = form;
    name = form.name;
    error = validateChoice(form, offers, cells);
    if (error !== null) {
      continue;
    }
    await store.save(form);
    try {
      await panel.context.save();
    } catch (e) {
      error = trans.__('Could not save the notebook first: %1', errorMessage(e));
      continue;
    }
    let job: IJob;
    try {
      job = await submitJob(submission(panel.context.path, form, cells));
    } catch (e) {
      error = errorMessage(e);
      try {
        offers = await getOffers(); // show what is available now
      } catch {
        // keep the previous offers
      }
      continue;
    }
    Notification.success(trans.__('Job %1 submitted (%2).', job.name || job.id, job.state), {
      autoClose: 5000
    });
    await options.show(job);
    return job;
  }
}
