/**
 * Pure formatting helpers (no DOM, no requests): easy to test.
 */
import type { IAllocation, IJob, IReclaimWarning, ITeamOffers } from './api';

/**
 * A GPU-equivalent amount as the hub writes it: at most three decimals, no trailing zeros.
 */
export function formatGpuEq(value: number): string {
  return String(Math.round(value * 1000) / 1000);
}

/**
 * The status bar text for this server's allocation.
 */
export function allocationLabel(allocation: IAllocation): string {
  const label = allocation.label || allocation.allocation || allocation.offer;
  return allocation.simulated ? `${label} · simulated` : label;
}

/**
 * A time of day in local time, 24-hour: "14:05"; "" for a time that does not parse.
 */
export function formatClock(iso: string | null | undefined): string {
  const t = parseTime(iso);
  if (t === null) {
    return '';
  }
  const d = new Date(t);
  return `${String(d.getHours()).padStart(2, '0')}:${String(d.getMinutes()).padStart(2, '0')}`;
}

/**
 * The status bar text while the hub warns that the GPUs will be reclaimed: idle, "GPU idle ·
 * stops 14:05" or "GPU idle · to CPU 14:05"; a share over its memory, "GPU memory over share ·
 * stops 14:05"; a process on a GPU it does not hold, "Process on a GPU not yours · stops 14:05"
 * (local time).
 */
export function reclaimLabel(warning: IReclaimWarning): string {
  const when = formatClock(warning.reclaim_at) || 'soon';
  if (warning.reason === 'memory') {
    return `GPU memory over share · stops ${when}`;
  }
  if (warning.reason === 'device') {
    return `Process on a GPU not yours · stops ${when}`;
  }
  return warning.action === 'cpu' ? `GPU idle · to CPU ${when}` : `GPU idle · stops ${when}`;
}

/**
 * The hub's pseudo-team of users in no team (`gpupool.core.quota.EVERYONE`).
 */
export const EVERYONE = 'everyone';

/**
 * Whether a team has no GPU quota at all (it may request CPU only).
 */
function cpuOnly(team: ITeamOffers): boolean {
  return Math.round(team.limit * 1000) <= 0;
}

/**
 * A team's quota in one line: "team vision: 1.5 of 3 GPU-eq used, 1.5 left; you hold 0.5 of
 * your 1 cap"; "CPU only (you are in no team)" for the pseudo-team of users in no team without a
 * GPU quota, "team x: CPU only" for a team without one.
 */
export function quotaLine(team: ITeamOffers): string {
  const noTeam = team.team === EVERYONE;
  if (cpuOnly(team)) {
    return noTeam ? 'CPU only (you are in no team)' : `team ${team.team}: CPU only`;
  }
  const who = noTeam ? 'users in no team' : `team ${team.team}`;
  let line =
    `${who}: ${formatGpuEq(team.used)} of ${formatGpuEq(team.limit)} GPU-eq used, ` +
    `${formatGpuEq(team.left)} left`;
  if (team.user_cap !== null && team.user_cap !== undefined) {
    line += `; you hold ${formatGpuEq(team.user_used)} of your ${formatGpuEq(team.user_cap)} cap`;
  }
  return line;
}

/**
 * A team in the dialog's team menu: "vision (1.5 of 3 GPU-eq left)", "nlp (CPU only)",
 * "no team (CPU only)".
 */
export function teamChoiceLabel(team: ITeamOffers): string {
  const name = team.team === EVERYONE ? 'no team' : team.team;
  if (cpuOnly(team)) {
    return `${name} (CPU only)`;
  }
  return `${name} (${formatGpuEq(team.left)} of ${formatGpuEq(team.limit)} GPU-eq left)`;
}

/**
 * The message of an error (what the server said, for a failed request), or the value as text.
 */
export function errorMessage(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

function plural(n: number, one: string, many: string): string {
  return `${n} ${n === 1 ? one : many}`;
}

/**
 * What a job holds: "4 GPUs (2 per node × 2 nodes) · h100" or "CPU · 2 ranks".
 */
export function jobResources(job: IJob): string {
  if (job.offer === 'cpu' || job.offer.startsWith('cpu-')) {
    return `CPU · ${plural(job.ranks, 'rank', 'ranks')}`;
  }
  const total = job.gpus * job.nodes;
  const layout = job.nodes > 1 ? ` (${job.gpus} per node × ${job.nodes} nodes)` : '';
  return `${plural(total, 'GPU', 'GPUs')}${layout} · ${job.offer}`;
}

function parseTime(iso: string | null | undefined): number | null {
  if (!iso) {
    return null;
  }
  const t = Date.parse(iso);
  return Number.isNaN(t) ? null : t;
}

/**
 * A span of time, short: "42 s", "3 min 05 s", "2 h 10 min", "3 d 4 h".
 */
export function formatSpan(ms: number): string {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) {
    return `${s} s`;
  }
  const m = Math.floor(s / 60);
  if (m < 60) {
    return `${m} min ${String(s % 60).padStart(2, '0')} s`;
  }
  const h = Math.floor(m / 60);
  if (h < 24) {
    return `${h} h ${String(m % 60).padStart(2, '0')} min`;
  }
  return `${Math.floor(h / 24)} d ${h % 24} h`;
}

/**
 * How long ago a job was created: "just now", "5 min ago", "2 h ago", "3 d ago".
 */
export function formatAge(created: string | null, now: number = Date.now()): string {
  const t = parseTime(created);
  if (t === null) {
    return '';
  }
  const s = Math.max(0, Math.floor((now - t) / 1000));
  if (s < 10) {
    return 'just now';
  }
  if (s < 60) {
    return `${s} s ago`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ago`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)} h ago`;
  }
  return `${Math.floor(s / 86400)} d ago`;
}

/**
 * How long a job has run (until it finished, or until now): "" when it has not started.
 */
export function jobDuration(job: IJob, now: number = Date.now()): string {
  const started = parseTime(job.started);
  if (started === null) {
    return '';
  }
  const end = parseTime(job.finished) ?? now;
  return formatSpan(end - started);
}

/**
 * A time limit in seconds, for people: "4 h", "90 min", "2 d".
 */
export function formatLimit(seconds: number): string {
  if (seconds % 86400 === 0) {
    return `${seconds / 86400} d`;
  }
  if (seconds % 3600 === 0) {
    return `${seconds / 3600} h`;
  }
  if (seconds % 60 === 0) {
    return `${seconds / 60} min`;
  }
  return `${seconds} s`;
}

/**
 * The number of bytes a string takes in UTF-8 (log offsets are byte offsets).
 */
export function utf8Length(text: string): number {
  let bytes = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c < 0x80) {
      bytes += 1;
    } else if (c < 0x800) {
      bytes += 2;
    } else if (c >= 0xd800 && c <= 0xdbff && i + 1 < text.length) {
      const next = text.charCodeAt(i + 1);
      if (next >= 0xdc00 && next <= 0xdfff) {
        bytes += 4;
        i++;
      } else {
        bytes += 3;
      }
    } else {
      bytes += 3;
    }
  }
  return bytes;
}
