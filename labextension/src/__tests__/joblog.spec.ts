import { nullTranslator } from '@jupyterlab/translation';

import * as api from '../api';
import { LOG_INTERVAL_MS, LogFollower } from '../joblog';

jest.mock('../api', () => {
  const actual = jest.requireActual('../api');
  return { ...actual, getLogs: jest.fn() };
});

const mocked = api as jest.Mocked<typeof api>;

describe('LogFollower', () => {
  let follower: LogFollower;
  let visible: boolean;

  beforeEach(() => {
    visible = true;
    follower = new LogFollower({
      trans: nullTranslator.load('gpupool_lab'),
      isVisible: () => visible
    });
    jest.useFakeTimers();
  });

  afterEach(() => {
    follower.dispose();
    jest.useRealTimers();
    jest.resetAllMocks();
  });

  it('shows a restarted log from its beginning', async () => {
    mocked.getLogs
      .mockResolvedValueOnce({ text: 'first try\n', size: 10, state: 'running' })
      .mockResolvedValueOnce({ text: '', size: 0, state: 'running' })
      .mockResolvedValueOnce({ text: 'again\n', size: 6, state: 'succeeded' })
      .mockResolvedValue({ text: '', size: 6, state: 'succeeded' });
    follower.follow('j1', 1);
    await jest.advanceTimersByTimeAsync(3 * LOG_INTERVAL_MS);
    expect(mocked.getLogs.mock.calls.map(c => [c[1], c[2]])).toEqual([
      [1, 0],
      [1, 10],
      [1, 0],
      [1, 6]
    ]);
    expect(follower.log.textContent).toBe('again\n');
    expect(follower.status.textContent).toBe('Job succeeded; end of log.');
  });

  it('reads nothing while hidden', async () => {
    visible = false;
    mocked.getLogs.mockResolvedValue({ text: '', size: 0, state: 'queued' });
    follower.follow('j1', 0);
    await jest.advanceTimersByTimeAsync(5 * LOG_INTERVAL_MS);
    expect(mocked.getLogs).not.toHaveBeenCalled();
    visible = true;
    await jest.advanceTimersByTimeAsync(LOG_INTERVAL_MS);
    expect(mocked.getLogs).toHaveBeenCalledWith('j1', 0, 0);
    expect(follower.status.textContent).toBe('Waiting for the job to start…');
  });

  it('stops after repeated failures and reads on when resumed', async () => {
    mocked.getLogs.mockRejectedValue(new Error('The hub is not reachable.'));
    follower.follow('j1', 0);
    await jest.advanceTimersByTimeAsync(20 * LOG_INTERVAL_MS);
    expect(mocked.getLogs).toHaveBeenCalledTimes(5);
    expect(follower.status.textContent).toBe('Could not read the log: The hub is not reachable.');

    mocked.getLogs.mockReset();
    mocked.getLogs.mockResolvedValue({ text: '', size: 0, state: 'cancelled' });
    follower.resume();
    await jest.advanceTimersByTimeAsync(LOG_INTERVAL_MS);
    expect(mocked.getLogs).toHaveBeenCalledTimes(1);
    expect(follower.status.textContent).toBe('Job cancelled; this rank wrote nothing.');
  });

  it('lets only the latest follow read', async () => {
    mocked.getLogs.mockResolvedValue({ text: '', size: 0, state: 'running' });
    follower.follow('j1', 0);
    follower.follow('j2', 1);
    await jest.advanceTimersByTimeAsync(LOG_INTERVAL_MS / 2);
    follower.dispose();
    await jest.advanceTimersByTimeAsync(5 * LOG_INTERVAL_MS);
    const jobs = new Set(mocked.getLogs.mock.calls.slice(1).map(c => c[0]));
    expect(jobs).toEqual(new Set(['j2']));
    expect(mocked.getLogs).toHaveBeenCalledTimes(2);
  });
});
