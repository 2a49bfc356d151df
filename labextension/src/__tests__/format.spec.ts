import type { IJob } from '../api';
import {
  allocationLabel,
  errorMessage,
  formatAge,
  formatClock,
  formatGpuEq,
  formatLimit,
  formatSpan,
  jobDuration,
  jobResources,
  quotaLine,
  reclaimLabel,
  teamChoiceLabel,
  utf8Length
} from '../format';

function job(partial: Partial<IJob> = {}): IJob {
  return {
    id: 'abc123',
    name: 'train',
    owner: 'alice',
    team: 'vision',
    offer: 'h100',
    gpus: 2,
    nodes: 1,
    ranks: 2,
    state: 'running',
    reason: '',
    created: '2025-01-01T10:00:00+00:00',
    started: '2025-01-01T10:01:00+00:00',
    finished: null,
    exit_codes: {},
    queue_position: null,
    devices: ['0', '1'],
    ...partial
  };
}

describe('format', () => {
  it('writes GPU-eq like the hub', () => {
    expect(formatGpuEq(0.5)).toBe('0.5');
    expect(formatGpuEq(3)).toBe('3');
    expect(formatGpuEq(0.125)).toBe('0.125');
    expect(formatGpuEq(0.1 + 0.2)).toBe('0.3');
  });

  it('labels the allocation, marking a simulated one', () => {
    const base = {
      offer: 'h100',
      team: 'vision',
      allocation: 'GPU 0',
      idle_since: null,
      warning: null
    };
    expect(allocationLabel({ ...base, label: 'H100-80GB ×1 · vision', simulated: false })).toBe(
      'H100-80GB ×1 · vision'
    );
    expect(allocationLabel({ ...base, label: 'MIG 3g.40gb', simulated: true })).toBe(
      'MIG 3g.40gb · simulated'
    );
  });

  it('labels the idle warning with the local time the GPU goes', () => {
    // 14:05 local time, whatever the time zone the tests run in
    const reclaimAt = new Date(2025, 0, 1, 14, 5, 30).toISOString();
    const message = 'This server’s GPU (h100) has been idle; at 13:05 UTC it is reclaimed.';
    expect(reclaimLabel({ reclaim_at: reclaimAt, action: 'stop', reason: 'idle', message })).toBe(
      'GPU idle · stops 14:05'
    );
    expect(reclaimLabel({ reclaim_at: reclaimAt, action: 'cpu', reason: 'idle', message })).toBe(
      'GPU idle · to CPU 14:05'
    );
    expect(
      reclaimLabel({ reclaim_at: 'not a time', action: 'stop', reason: 'idle', message })
    ).toBe('GPU idle · stops soon');
    expect(reclaimLabel({ reclaim_at: reclaimAt, action: 'stop', reason: 'memory', message })).toBe(
      'GPU memory over share · stops 14:05'
    );
    expect(reclaimLabel({ reclaim_at: reclaimAt, action: 'stop', reason: 'device', message })).toBe(
      'Process on a GPU not yours · stops 14:05'
    );
    expect(formatClock(new Date(2025, 0, 1, 9, 0).toISOString())).toBe('09:00');
    expect(formatClock(null)).toBe('');
  });

  it('writes a quota line', () => {
    const team = {
      team: 'vision',
      used: 1.5,
      limit: 3,
      guarantee: 2,
      borrow_limit: 1,
      left: 1.5,
      user_used: 0.5,
      user_cap: 1,
      offers: []
    };
    expect(quotaLine(team)).toBe(
      'team vision: 1.5 of 3 GPU-eq used, 1.5 left; you hold 0.5 of your 1 cap'
    );
    expect(quotaLine({ ...team, user_cap: null })).toBe(
      'team vision: 1.5 of 3 GPU-eq used, 1.5 left'
    );
  });

  it('says CPU only for a user in no team, not a quota of 0 of 0', () => {
    const everyone = {
      team: 'everyone',
      used: 0,
      limit: 0,
      guarantee: 0,
      borrow_limit: 0,
      left: 0,
      user_used: 0,
      user_cap: null,
      offers: []
    };
    expect(quotaLine(everyone)).toBe('CPU only (you are in no team)');
    expect(teamChoiceLabel(everyone)).toBe('no team (CPU only)');
    expect(quotaLine({ ...everyone, team: 'guests' })).toBe('team guests: CPU only');
    expect(teamChoiceLabel({ ...everyone, team: 'guests' })).toBe('guests (CPU only)');
    // An admin may give users in no team a GPU quota.
    const shared = { ...everyone, limit: 0.25, left: 0.125, used: 0.125 };
    expect(quotaLine(shared)).toBe('users in no team: 0.125 of 0.25 GPU-eq used, 0.125 left');
    expect(teamChoiceLabel(shared)).toBe('no team (0.125 of 0.25 GPU-eq left)');
    expect(teamChoiceLabel({ ...shared, team: 'vision' })).toBe(
      'vision (0.125 of 0.25 GPU-eq left)'
    );
  });

  it('takes the message of an error', () => {
    expect(errorMessage(new Error('The hub is not reachable.'))).toBe('The hub is not reachable.');
    expect(errorMessage('plain')).toBe('plain');
  });

  it('describes what a job holds', () => {
    expect(jobResources(job())).toBe('2 GPUs · h100');
    expect(jobResources(job({ gpus: 1 }))).toBe('1 GPU · h100');
    expect(jobResources(job({ nodes: 2 }))).toBe('4 GPUs (2 per node × 2 nodes) · h100');
    expect(jobResources(job({ offer: 'cpu', ranks: 1 }))).toBe('CPU · 1 rank');
  });

  it('writes ages and durations', () => {
    const now = Date.parse('2025-01-01T10:06:30+00:00');
    expect(formatAge('2025-01-01T10:06:25+00:00', now)).toBe('just now');
    expect(formatAge('2025-01-01T10:06:00+00:00', now)).toBe('30 s ago');
    expect(formatAge('2025-01-01T10:00:00+00:00', now)).toBe('6 min ago');
    expect(formatAge('2024-12-31T10:00:00+00:00', now)).toBe('1 d ago');
    expect(formatAge(null, now)).toBe('');
    expect(jobDuration(job(), now)).toBe('5 min 30 s');
    expect(jobDuration(job({ finished: '2025-01-01T12:11:00+00:00' }), now)).toBe('2 h 10 min');
    expect(jobDuration(job({ started: null }), now)).toBe('');
    expect(formatSpan(42_000)).toBe('42 s');
    expect(formatSpan(3 * 86400_000 + 4 * 3600_000)).toBe('3 d 4 h');
  });

  it('writes time limits', () => {
    expect(formatLimit(14400)).toBe('4 h');
    expect(formatLimit(5400)).toBe('90 min');
    expect(formatLimit(172800)).toBe('2 d');
    expect(formatLimit(61)).toBe('61 s');
  });

  it('counts UTF-8 bytes', () => {
    expect(utf8Length('abc')).toBe(3);
    expect(utf8Length('é')).toBe(2);
    expect(utf8Length('×')).toBe(2);
    expect(utf8Length('€')).toBe(3);
    expect(utf8Length('🚀')).toBe(4);
    expect(utf8Length('loss=0.1 🚀\n')).toBe(new TextEncoder().encode('loss=0.1 🚀\n').length);
  });
});
