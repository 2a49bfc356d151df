import { Notification } from '@jupyterlab/apputils';
import { nullTranslator } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import * as api from '../api';
import { ALLOCATION_REFRESH_INTERVAL, AllocationStatus } from '../status';

jest.mock('../api', () => ({
  ...jest.requireActual('../api'),
  getAllocation: jest.fn()
}));

const mocked = api as jest.Mocked<typeof api>;

async function settle(): Promise<void> {
  for (let i = 0; i < 5; i++) {
    await new Promise(resolve => setTimeout(resolve, 0));
  }
}

function allocation(partial: Partial<api.IAllocation> = {}): api.IAllocation {
  return {
    label: 'H100-80GB ×1 · vision',
    offer: 'h100',
    team: 'vision',
    simulated: false,
    allocation: 'alloc-7',
    idle_since: null,
    warning: null,
    ...partial
  };
}

/**
 * A warning for `hour:minute` local time (so the label does not depend on the time zone).
 */
function warned(action: api.ReclaimAction, hour: number, minute: number): Partial<api.IAllocation> {
  return {
    idle_since: new Date(2025, 0, 1, hour - 1, minute).toISOString(),
    warning: {
      reclaim_at: new Date(2025, 0, 1, hour, minute).toISOString(),
      action,
      reason: 'idle',
      message: `This server's GPU (h100) has been idle; at ${hour}:${minute} it will be ${
        action === 'cpu' ? 'restarted without a GPU' : 'stopped'
      }.`
    }
  };
}

describe('AllocationStatus', () => {
  let item: AllocationStatus | null = null;

  afterEach(() => {
    item?.dispose();
    item = null;
    jest.useRealTimers();
    jest.resetAllMocks();
    jest.restoreAllMocks();
  });

  function create(): AllocationStatus {
    item = new AllocationStatus({ trans: nullTranslator.load('gpupool_lab') });
    Widget.attach(item, document.body);
    return item;
  }

  /**
   * The notification calls, recorded (and kept out of the application's notification list).
   */
  function spyNotifications(): { warning: jest.SpyInstance; dismiss: jest.SpyInstance } {
    let n = 0;
    return {
      warning: jest.spyOn(Notification, 'warning').mockImplementation(() => `note-${++n}`),
      dismiss: jest.spyOn(Notification, 'dismiss').mockImplementation(() => undefined)
    };
  }

  /**
   * Let the poll's first load run (fake timers: a timeout of 0 set while timers run counts
   * as 1 ms, and the poll sets a few).
   */
  async function firstLoad(): Promise<void> {
    await jest.advanceTimersByTimeAsync(100);
  }

  /**
   * Let the poll's next refresh run (fake timers).
   */
  async function nextRefresh(): Promise<void> {
    await jest.advanceTimersByTimeAsync(ALLOCATION_REFRESH_INTERVAL);
  }

  it("shows the allocation's label", async () => {
    mocked.getAllocation.mockResolvedValue(allocation({ allocation: 'GPU-1234' }));
    const widget = create();
    await settle();
    expect(widget.node.classList.contains('gpupool-status')).toBe(true);
    expect(widget.node.textContent).toBe('H100-80GB ×1 · vision');
  });

  it('says when the inventory is simulated', async () => {
    mocked.getAllocation.mockResolvedValue(
      allocation({
        label: 'MIG 3g.40gb · nlp',
        offer: 'mig-3g.40gb',
        team: 'nlp',
        simulated: true,
        allocation: 'MIG-GPU-0/1/0'
      })
    );
    const widget = create();
    await settle();
    expect(widget.node.textContent).toBe('MIG 3g.40gb · nlp · simulated');
  });

  it("shows that it is unavailable, with the server's message", async () => {
    mocked.getAllocation.mockRejectedValue(new Error('This server runs outside JupyterHub.'));
    const widget = create();
    await settle();
    expect(widget.node.textContent).toBe('GPU: unavailable');
    expect(widget.node.title).toBe('This server runs outside JupyterHub.');
  });

  it('refreshes every minute until it is disposed', async () => {
    jest.useFakeTimers();
    mocked.getAllocation.mockResolvedValue(allocation());
    const widget = create();
    await firstLoad();
    expect(mocked.getAllocation).toHaveBeenCalledTimes(1);
    await jest.advanceTimersByTimeAsync(ALLOCATION_REFRESH_INTERVAL - 1000);
    expect(mocked.getAllocation).toHaveBeenCalledTimes(1);
    await jest.advanceTimersByTimeAsync(1000);
    expect(mocked.getAllocation).toHaveBeenCalledTimes(2);
    await nextRefresh();
    expect(mocked.getAllocation).toHaveBeenCalledTimes(3);
    widget.dispose();
    await jest.advanceTimersByTimeAsync(10 * ALLOCATION_REFRESH_INTERVAL);
    expect(mocked.getAllocation).toHaveBeenCalledTimes(3);
  });

  it('switches to the warning state while the GPU is idle, and back when it is used', async () => {
    jest.useFakeTimers();
    const notes = spyNotifications();
    const stop = allocation(warned('stop', 14, 5));
    mocked.getAllocation
      .mockResolvedValueOnce(allocation())
      .mockResolvedValueOnce(stop)
      .mockResolvedValueOnce(allocation());
    const widget = create();
    await firstLoad();
    expect(widget.node.textContent).toBe('H100-80GB ×1 · vision');
    expect(widget.node.classList.contains('gpupool-mod-warning')).toBe(false);
    expect(widget.warning).toBeNull();

    await nextRefresh();
    expect(widget.node.textContent).toBe('GPU idle · stops 14:05');
    expect(widget.node.title).toBe(stop.warning?.message);
    expect(widget.node.classList.contains('gpupool-mod-warning')).toBe(true);
    expect(widget.warning).toEqual(stop.warning);

    await nextRefresh();
    expect(widget.node.textContent).toBe('H100-80GB ×1 · vision');
    expect(widget.node.title).toBe('This server’s GPU allocation: alloc-7 (click for GPU jobs)');
    expect(widget.node.classList.contains('gpupool-mod-warning')).toBe(false);
    expect(widget.warning).toBeNull();
    // the warning's notification no longer holds
    expect(notes.warning).toHaveBeenCalledTimes(1);
    expect(notes.dismiss).toHaveBeenCalledWith('note-1');
  });

  it('says "to CPU" when the server is to be restarted without a GPU', async () => {
    spyNotifications();
    mocked.getAllocation.mockResolvedValue(allocation(warned('cpu', 9, 30)));
    const widget = create();
    await settle();
    expect(widget.node.textContent).toBe('GPU idle · to CPU 09:30');
    expect(widget.node.classList.contains('gpupool-mod-warning')).toBe(true);
  });

  it('notifies once per reclaim time', async () => {
    jest.useFakeTimers();
    const notes = spyNotifications();
    const first = allocation(warned('stop', 14, 5));
    const later = allocation(warned('cpu', 15, 40));
    mocked.getAllocation
      .mockResolvedValueOnce(first)
      .mockResolvedValueOnce(first)
      .mockResolvedValueOnce({ ...first, idle_since: null }) // the same warning, asked again
      .mockResolvedValueOnce(later)
      .mockResolvedValueOnce(later)
      .mockResolvedValueOnce(allocation())
      .mockResolvedValueOnce(later); // seen before: the status shows it, no new notification
    create();
    await firstLoad();
    expect(notes.warning).toHaveBeenCalledTimes(1);
    expect(notes.warning).toHaveBeenLastCalledWith(first.warning?.message, {
      autoClose: false
    });
    await nextRefresh();
    await nextRefresh();
    expect(notes.warning).toHaveBeenCalledTimes(1);
    expect(notes.dismiss).not.toHaveBeenCalled();

    await nextRefresh();
    expect(notes.warning).toHaveBeenCalledTimes(2);
    expect(notes.warning).toHaveBeenLastCalledWith(later.warning?.message, {
      autoClose: false
    });
    expect(notes.dismiss).toHaveBeenCalledWith('note-1'); // the earlier warning, replaced
    await nextRefresh();
    await nextRefresh();
    await nextRefresh();
    expect(mocked.getAllocation).toHaveBeenCalledTimes(7);
    expect(notes.warning).toHaveBeenCalledTimes(2);
    expect(notes.dismiss).toHaveBeenCalledTimes(2);
    expect(item?.node.textContent).toBe('GPU idle · to CPU 15:40');
  });

  it('keeps showing the warning while the server cannot be asked', async () => {
    jest.useFakeTimers();
    spyNotifications();
    mocked.getAllocation
      .mockResolvedValueOnce(allocation(warned('stop', 14, 5)))
      .mockRejectedValue(new Error('The server is not answering.'));
    const widget = create();
    await firstLoad();
    await nextRefresh();
    expect(mocked.getAllocation).toHaveBeenCalledTimes(2);
    expect(widget.node.textContent).toBe('GPU idle · stops 14:05');
    expect(widget.node.classList.contains('gpupool-mod-warning')).toBe(true);
    expect(widget.node.classList.contains('gpupool-mod-error')).toBe(false);
  });
});
