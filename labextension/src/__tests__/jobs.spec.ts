import { nullTranslator } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import * as api from '../api';
import { JobsPanel } from '../jobs';

jest.mock('../api', () => {
  const actual = jest.requireActual('../api');
  return {
    ...actual,
    listJobs: jest.fn(),
    getJob: jest.fn(),
    getLogs: jest.fn()
  };
});

const mocked = api as jest.Mocked<typeof api>;

function job(partial: Partial<api.IJob>): api.IJob {
  return {
    id: 'j1',
    name: 'train',
    owner: 'alice',
    team: 'vision',
    offer: 'h100',
    gpus: 2,
    nodes: 1,
    ranks: 2,
    state: 'running',
    reason: '',
    created: new Date().toISOString(),
    started: new Date().toISOString(),
    finished: null,
    exit_codes: {},
    queue_position: null,
    devices: ['0', '1'],
    ...partial
  };
}

function page(jobs: api.IJob[], next: string | null = null): api.IJobPage {
  return { jobs, next };
}

describe('JobsPanel', () => {
  let panel: JobsPanel;

  beforeEach(() => {
    mocked.listJobs.mockResolvedValue(page([]));
    mocked.getLogs
      .mockResolvedValueOnce({ text: 'rank 0 says hi\n', size: 15, state: 'succeeded' })
      .mockResolvedValue({ text: '', size: 15, state: 'succeeded' });
    panel = new JobsPanel({ trans: nullTranslator.load('gpupool_lab') });
    Widget.attach(panel, document.body);
  });

  afterEach(() => {
    panel.dispose();
    jest.resetAllMocks();
  });

  it('says how to start when there are no jobs', async () => {
    mocked.listJobs.mockResolvedValue(page([]));
    await panel.refresh();
    const empty = panel.node.querySelector<HTMLElement>('.gpupool-empty');
    expect(empty?.hidden).toBe(false);
    expect(empty?.textContent).toBe("No jobs yet. Use Run distributed in a notebook's toolbar.");
  });

  it('lists jobs with their state as text and a state class', async () => {
    mocked.listJobs.mockResolvedValue(
      page([
        job({ id: 'j2', state: 'queued', started: null, queue_position: 1 }),
        job({
          id: 'j1',
          state: 'failed',
          finished: new Date().toISOString(),
          exit_codes: { '0': 1 }
        })
      ])
    );
    await panel.refresh();
    expect(panel.node.querySelector<HTMLElement>('.gpupool-empty')?.hidden).toBe(true);
    const items = panel.node.querySelectorAll<HTMLElement>('.gpupool-job');
    expect(Array.from(items).map(i => i.dataset.jobId)).toEqual(['j2', 'j1']);
    const queued = items[0].querySelector('.gpupool-state-queued');
    expect(queued?.textContent).toBe('queued');
    expect(items[0].textContent).toContain('#1 in queue');
    expect(items[1].querySelector('.gpupool-state-failed')?.textContent).toBe('failed');
  });

  it('shows the selected job with ranks, cancel/resubmit and its log', async () => {
    mocked.listJobs.mockResolvedValue(
      page([job({ id: 'j1', state: 'succeeded', finished: new Date().toISOString() })])
    );
    await panel.open('j1');
    const detail = panel.node.querySelector<HTMLElement>('.gpupool-job-detail');
    expect(detail?.hidden).toBe(false);
    const ranks = panel.node.querySelectorAll('select[name="rank"] option');
    expect(ranks.length).toBe(2);
    expect(panel.node.querySelector<HTMLButtonElement>('.gpupool-cancel')?.disabled).toBe(true);
    expect(panel.node.querySelector<HTMLButtonElement>('.gpupool-resubmit')?.disabled).toBe(false);
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(mocked.getLogs).toHaveBeenCalledWith('j1', 0, 0);
    expect(panel.node.querySelector('.gpupool-log')?.textContent).toBe('rank 0 says hi\n');
    expect(mocked.getLogs).toHaveBeenLastCalledWith('j1', 0, 15);
    expect(panel.node.querySelector('.gpupool-log-status')?.textContent).toBe(
      'Job succeeded; end of log.'
    );
  });

  it('shows Resubmit only for a job this server can resubmit, enabled once it ended', async () => {
    const finished = new Date().toISOString();
    mocked.listJobs.mockResolvedValue(
      page([
        job({ id: 'done', state: 'succeeded', finished, resubmittable: true }),
        job({ id: 'running', state: 'running', resubmittable: true }),
        job({ id: 'elsewhere', state: 'failed', finished, resubmittable: false }),
        job({ id: 'old', state: 'failed', finished })
      ])
    );
    const resubmit = () => panel.node.querySelector<HTMLButtonElement>('.gpupool-resubmit');

    await panel.open('done');
    expect(resubmit()?.hidden).toBe(false);
    expect(resubmit()?.disabled).toBe(false);

    await panel.open('running');
    expect(resubmit()?.hidden).toBe(false);
    expect(resubmit()?.disabled).toBe(true);
    expect(resubmit()?.title).toBe('A job can be resubmitted once it has ended');

    await panel.open('elsewhere');
    expect(resubmit()?.hidden).toBe(true);

    // An older server extension does not say: no button.
    await panel.open('old');
    expect(resubmit()?.hidden).toBe(true);
  });

  it('shows the devices a finished job ran on', async () => {
    mocked.listJobs.mockResolvedValue(
      page([
        job({
          id: 'j1',
          state: 'succeeded',
          finished: new Date().toISOString(),
          devices: ['2', '3']
        })
      ])
    );
    await panel.open('j1');
    const info = panel.node.querySelector('.gpupool-detail-info');
    const rows = Array.from(info?.querySelectorAll('dt') ?? []).map(dt => [
      dt.textContent,
      dt.nextElementSibling?.textContent
    ]);
    expect(rows).toContainEqual(['Ran on', '2, 3']);
  });

  it('never says a CPU job waits for GPUs', async () => {
    mocked.listJobs.mockResolvedValue(
      page([
        job({
          id: 'cpu1',
          offer: 'cpu',
          gpus: 2,
          ranks: 2,
          state: 'queued',
          started: null,
          queue_position: 1,
          devices: [],
          reason: 'CPU-only job limit reached: 2 of 2 processes per node'
        })
      ])
    );
    mocked.getLogs.mockReset();
    mocked.getLogs.mockResolvedValue({ text: '', size: 0, state: 'queued' });
    await panel.open('cpu1');
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(panel.node.textContent).toContain('CPU · 2 ranks');
    expect(panel.node.textContent).toContain('Waiting for the job to start…');
    expect(panel.node.textContent).not.toMatch(/waiting for GPUs/i);
  });

  it('pages through older jobs on demand and keeps the pages open on reload', async () => {
    const pages: Record<string, api.IJobPage> = {
      first: page([job({ id: 'j4' }), job({ id: 'j3' })], 'after-j3'),
      'after-j3': page([job({ id: 'j2' }), job({ id: 'j1' })], 'after-j1'),
      'after-j1': page([job({ id: 'j0' })])
    };
    mocked.listJobs.mockImplementation(async cursor => pages[cursor ?? 'first']);
    const ids = () =>
      Array.from(panel.node.querySelectorAll<HTMLElement>('.gpupool-job')).map(
        li => li.dataset.jobId
      );
    const older = () => panel.node.querySelector<HTMLButtonElement>('.gpupool-older');

    await panel.refresh();
    expect(ids()).toEqual(['j4', 'j3']);
    expect(mocked.listJobs).toHaveBeenCalledTimes(1);
    expect(older()?.hidden).toBe(false);
    expect(older()?.textContent).toBe('Show older jobs');

    older()?.click();
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(ids()).toEqual(['j4', 'j3', 'j2', 'j1']);
    expect(older()?.hidden).toBe(false);

    pages.first = page([job({ id: 'j5' }), job({ id: 'j4' })], 'after-j4');
    pages['after-j4'] = page([job({ id: 'j3' }), job({ id: 'j2' })], 'after-j2');
    pages['after-j2'] = page([job({ id: 'j1' }), job({ id: 'j0' })]);
    mocked.listJobs.mockClear();
    await panel.refresh(); // a new job came: the same two pages, now one later
    expect(ids()).toEqual(['j5', 'j4', 'j3', 'j2']);
    expect(mocked.listJobs.mock.calls.map(c => c[0])).toEqual([undefined, 'after-j4']);

    older()?.click();
    await new Promise(resolve => setTimeout(resolve, 10));
    expect(ids()).toEqual(['j5', 'j4', 'j3', 'j2', 'j1', 'j0']);
    expect(older()?.hidden).toBe(true); // the last page
  });

  it('shows what the server said when the list fails', async () => {
    mocked.listJobs.mockRejectedValue(new Error('The hub is not reachable.'));
    await expect(panel.refresh()).rejects.toThrow('The hub is not reachable.');
    expect(panel.node.querySelector('.gpupool-jobs-error')?.textContent).toBe(
      'The hub is not reachable.'
    );
  });

  it('follows a running rank from the offset the server gives', async () => {
    mocked.listJobs.mockResolvedValue(page([job({ id: 'j3', state: 'running', ranks: 1 })]));
    mocked.getLogs.mockReset();
    mocked.getLogs
      // "é" cut in half: the server holds its first byte back and says where to go on from.
      .mockResolvedValueOnce({ text: 'step 1 loss ', size: 12, state: 'running' })
      .mockResolvedValueOnce({ text: 'é=0.5\n', size: 19, state: 'succeeded' })
      .mockResolvedValue({ text: '', size: 19, state: 'succeeded' });
    jest.useFakeTimers();
    try {
      await panel.open('j3');
      await jest.advanceTimersByTimeAsync(5000);
    } finally {
      jest.useRealTimers();
    }
    expect(mocked.getLogs.mock.calls.map(c => c[2])).toEqual([0, 12, 19]);
    expect(panel.node.querySelector('.gpupool-log')?.textContent).toBe('step 1 loss é=0.5\n');
  });
});
