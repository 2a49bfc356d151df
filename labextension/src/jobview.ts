/**
 * What the GPU jobs panel shows of a job: the texts of its row in the list and of its details,
 * and its state badge. No requests; the texts are pure functions of the job and the time.
 */
import type { TranslationBundle } from '@jupyterlab/translation';

import { element } from './dom';

import { IJob, isFinal } from './api';
import { formatAge, formatLimit, jobDuration, jobResources } from './format';

/**
 * An ISO time in the browser's locale and time zone ("" for none; as given when it does not
 * parse).
 */
export function localTime(iso: string | null): string {
  if (!iso) {
    return '';
  }
  const t = new Date(iso);
  return Number.isNaN(t.getTime()) ? iso : t.toLocaleString();
}

/**
 * A state as text with the class `gpupool-state-<state>`.
 */
export function stateBadge(state: string): HTMLSpanElement {
  const badge = element('span', `gpupool-state gpupool-state-${state}`, state);
  badge.dataset.state = state;
  return badge;
}

/**
 * The second line of a job's row, as `[class name, text]` parts: resources, team, age, how long
 * it ran and its place in the queue.
 *
 * @param now - the time, in milliseconds since the epoch
 */
export function rowParts(job: IJob, now: number, trans: TranslationBundle): [string, string][] {
  const parts: [string, string][] = [
    ['gpupool-job-gpus', jobResources(job)],
    ['gpupool-job-team', job.team],
    ['gpupool-job-age', formatAge(job.created, now)]
  ];
  const duration = jobDuration(job, now);
  if (duration) {
    parts.push(['gpupool-job-duration', trans.__('ran %1', duration)]);
  }
  if (job.state === 'queued' && job.queue_position !== null) {
    parts.push(['gpupool-job-queue', trans.__('#%1 in queue', job.queue_position)]);
  }
  return parts;
}

/**
 * The details of a job, as `[label, value]` rows. The devices show for an ended job too, as
 * "Ran on".
 *
 * @param now - the time, in milliseconds since the epoch
 */
export function detailRows(job: IJob, now: number, trans: TranslationBundle): [string, string][] {
  const rows: [string, string][] = [[trans.__('Id'), job.id]];
  if (job.reason) {
    rows.push([trans.__('Reason'), job.reason]);
  }
  rows.push(
    [trans.__('Team'), job.team],
    [trans.__('Resources'), jobResources(job)],
    [trans.__('Created'), `${localTime(job.created)} (${formatAge(job.created, now)})`]
  );
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
  const devices = Array.isArray(job.devices) ? job.devices : [];
  if (devices.length > 0) {
    const label = isFinal(job.state) ? trans.__('Ran on') : trans.__('Devices');
    rows.push([label, devices.join(', ')]);
  }
  const codes = Object.entries(job.exit_codes ?? {});
  if (codes.length > 0) {
    rows.push([
      trans.__('Exit codes'),
      codes.map(([rank, code]) => trans.__('rank %1: %2', rank, code)).join(', ')
    ]);
  }
  return rows;
}
