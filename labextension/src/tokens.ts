/**
 * Command ids, plugin ids and tokens of the gpupool extension.
 *
 * This module is a leaf: it imports nothing from the rest of the extension, so every other
 * module (components included) may import it without creating an import cycle.
 */
import { Token } from '@lumino/coreutils';

/**
 * The extension's command ids.
 */
export namespace CommandIDs {
  /**
   * Open the "Run distributed" dialog for a notebook (args: `{ panelId?: string }`,
   * the id of a notebook panel; the current notebook when omitted).
   */
  export const runDistributed = 'gpupool:run-distributed';

  /**
   * Show the GPU jobs panel (args: `{ jobId?: string }` selects that job).
   */
  export const openJobs = 'gpupool:open-jobs';

  /**
   * Reload the job list of the GPU jobs panel now.
   */
  export const refreshJobs = 'gpupool:refresh-jobs';
}

/**
 * The plugin ids (prefixed with the package name so that `disabledExtensions` works).
 */
export namespace PluginIDs {
  export const jobs = 'gpupool-lab:jobs';
  export const runDistributed = 'gpupool-lab:run-distributed';
  export const status = 'gpupool-lab:status';
}

/**
 * The DOM id of the GPU jobs panel (also its id in the shell and the layout restorer).
 */
export const JOBS_PANEL_ID = 'gpupool-jobs';

/**
 * The status bar item id.
 */
export const STATUS_ITEM_ID = 'gpupool-lab:status';

/**
 * Where the user's last "Run distributed" choice is kept (IStateDB key, localStorage key).
 */
export const LAST_CHOICE_KEY = 'gpupool-lab:last-choice';

/**
 * The translation domain of the extension.
 */
export const TRANSLATION_DOMAIN = 'gpupool_lab';

/**
 * The GPU jobs panel, for other plugins.
 */
export interface IGpupoolJobs {
  /**
   * Reveal the panel and select a job (reloading the list first).
   */
  open(jobId?: string): Promise<void>;

  /**
   * Reload the job list now.
   */
  refresh(): Promise<void>;
}

/**
 * The GPU jobs panel token.
 */
export const IGpupoolJobs = new Token<IGpupoolJobs>(
  'gpupool-lab:IGpupoolJobs',
  'The GPU jobs panel of gpupool: reveal it and select a job.'
);
