/**
 * gpupool in JupyterLab: "Run distributed" (notebook toolbar and command palette), the GPU jobs
 * panel (left sidebar) and this server's allocation (status bar, skipped where there is none).
 * Tested in JupyterLab's light and dark themes (tests/lab/test_browser.py); Notebook 7 is not
 * installed or tested.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import type { DocumentRegistry } from '@jupyterlab/docregistry';
import { INotebookModel, INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IStateDB } from '@jupyterlab/statedb';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator, TranslationBundle } from '@jupyterlab/translation';
import { ToolbarButton } from '@jupyterlab/ui-components';
import type { CommandRegistry } from '@lumino/commands';
import type { ReadonlyPartialJSONObject } from '@lumino/coreutils';
import type { IDisposable } from '@lumino/disposable';

import type { IJob } from './api';
import { gpuIcon } from './icons';
import { JobsPanel } from './jobs';
import { AllocationStatus } from './status';
import {
  CommandIDs,
  IGpupoolJobs,
  JOBS_PANEL_ID,
  PluginIDs,
  STATUS_ITEM_ID,
  TRANSLATION_DOMAIN
} from './tokens';

const CATEGORY = 'GPU pool';

function bundle(translator: ITranslator | null): TranslationBundle {
  return (translator ?? nullTranslator).load(TRANSLATION_DOMAIN);
}

/**
 * The GPU jobs panel in the left sidebar.
 */
const jobsPlugin: JupyterFrontEndPlugin<IGpupoolJobs> = {
  id: PluginIDs.jobs,
  description: 'The GPU jobs panel: your gpupool jobs, per-rank logs, cancel and resubmit.',
  autoStart: true,
  provides: IGpupoolJobs,
  optional: [ILayoutRestorer, ICommandPalette, ITranslator],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    translator: ITranslator | null
  ): IGpupoolJobs => {
    const trans = bundle(translator);
    const panel = new JobsPanel({ trans });
    app.shell.add(panel, 'left', { rank: 650, type: 'GPU jobs' });
    if (restorer) {
      restorer.add(panel, JOBS_PANEL_ID);
    }

    const service: IGpupoolJobs = {
      open: async (jobId?: string) => {
        app.shell.activateById(panel.id);
        await panel.open(jobId);
      },
      refresh: () => panel.refresh()
    };

    app.commands.addCommand(CommandIDs.openJobs, {
      label: trans.__('Show GPU jobs'),
      caption: trans.__('Show the GPU jobs panel'),
      icon: gpuIcon,
      describedBy: {
        args: {
          type: 'object',
          properties: {
            jobId: { type: 'string', description: trans.__('The job to select') }
          }
        }
      },
      execute: args => service.open(typeof args.jobId === 'string' ? args.jobId : undefined)
    });
    app.commands.addCommand(CommandIDs.refreshJobs, {
      label: trans.__('Reload GPU jobs'),
      caption: trans.__('Reload the GPU jobs list now'),
      describedBy: { args: { type: 'object', properties: {} } },
      execute: () => panel.open()
    });
    if (palette) {
      palette.addItem({ command: CommandIDs.openJobs, category: CATEGORY });
      palette.addItem({ command: CommandIDs.refreshJobs, category: CATEGORY });
    }
    return service;
  }
};

/**
 * The toolbar button on every notebook panel.
 */
class RunDistributedButton implements DocumentRegistry.IWidgetExtension<
  NotebookPanel,
  INotebookModel
> {
  constructor(
    private _commands: CommandRegistry,
    private _trans: TranslationBundle
  ) {}

  createNew(panel: NotebookPanel): IDisposable {
    const button = new ToolbarButton({
      className: 'gpupool-run-distributed',
      icon: gpuIcon,
      label: this._trans.__('Run distributed'),
      tooltip: this._trans.__('Run this notebook as a multi-GPU distributed job'),
      onClick: () => {
        void this._commands.execute(CommandIDs.runDistributed, { panelId: panel.id });
      }
    });
    button.addClass('gpupool-run-distributed-item');
    button.node.dataset.command = CommandIDs.runDistributed;
    if (!panel.toolbar.insertAfter('cellType', 'gpupool-run-distributed', button)) {
      panel.toolbar.insertItem(10, 'gpupool-run-distributed', button);
    }
    return button;
  }
}

/**
 * "Run distributed": the command, its dialog and the notebook toolbar button.
 */
const runPlugin: JupyterFrontEndPlugin<void> = {
  id: PluginIDs.runDistributed,
  description: 'Run distributed: submit a notebook as a multi-GPU DDP job of the GPU pool.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IGpupoolJobs, ICommandPalette, IStateDB, ITranslator],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    jobs: IGpupoolJobs | null,
    palette: ICommandPalette | null,
    state: IStateDB | null,
    translator: ITranslator | null
  ): void => {
    const trans = bundle(translator);

    const panelFor = (args: ReadonlyPartialJSONObject): NotebookPanel | null => {
      const id = args.panelId;
      if (typeof id === 'string') {
        return tracker.find(p => p.id === id) ?? null;
      }
      return tracker.currentWidget;
    };

    const show = async (job: IJob): Promise<void> => {
      if (jobs) {
        await jobs.open(job.id);
      } else if (app.commands.hasCommand(CommandIDs.openJobs)) {
        await app.commands.execute(CommandIDs.openJobs, { jobId: job.id });
      }
    };

    app.commands.addCommand(CommandIDs.runDistributed, {
      label: trans.__('Run distributed'),
      caption: trans.__('Run the notebook as a multi-GPU distributed (DDP) job'),
      icon: args => (args.isPalette ? undefined : gpuIcon),
      describedBy: {
        args: {
          type: 'object',
          properties: {
            panelId: {
              type: 'string',
              description: trans.__('The id of the notebook panel (the current notebook if none)')
            }
          }
        }
      },
      isEnabled: args => panelFor(args) !== null,
      execute: async args => {
        const panel = panelFor(args);
        if (panel !== null) {
          const { runDistributed } = await import('./run');
          await runDistributed({ panel, state, trans, show });
        }
      }
    });
    if (palette) {
      palette.addItem({ command: CommandIDs.runDistributed, category: CATEGORY });
    }
    tracker.currentChanged.connect(() => {
      app.commands.notifyCommandChanged(CommandIDs.runDistributed);
    }, runPlugin);

    app.docRegistry.addWidgetExtension('Notebook', new RunDistributedButton(app.commands, trans));
  }
};

/**
 * This server's allocation in the status bar (JupyterLab; skipped where there is none).
 */
const statusPlugin: JupyterFrontEndPlugin<void> = {
  id: PluginIDs.status,
  description: "Shows this server's GPU allocation in the status bar.",
  autoStart: true,
  optional: [IStatusBar, ITranslator],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    translator: ITranslator | null
  ): void => {
    if (!statusBar) {
      return;
    }
    const trans = bundle(translator);
    const item = new AllocationStatus({
      trans,
      onClick: () => {
        if (app.commands.hasCommand(CommandIDs.openJobs)) {
          void app.commands.execute(CommandIDs.openJobs);
        }
      }
    });
    statusBar.registerStatusItem(STATUS_ITEM_ID, { item, align: 'left', rank: 50 });
  }
};

const plugins: JupyterFrontEndPlugin<any>[] = [jobsPlugin, runPlugin, statusPlugin];

export default plugins;
