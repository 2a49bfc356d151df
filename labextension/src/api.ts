/**
 * The gpupool server extension's REST contract (under `<baseUrl>/gpupool/`), typed.
 */
import { requestAPI } from './request';

/**
 * What an offer gives per node: `gpu` (whole GPUs) and `mig` (MIG instances) are counted, one
 * line per count; `share` (a share of one GPU's memory) is always one per node; `cpu` runs any
 * number of processes per node (see `isCounted` and `isOnePerNode` in validate.ts).
 */
export type OfferKind = 'cpu' | 'gpu' | 'mig' | 'share';

/**
 * The hub's verdict on a request (`gpupool.core.admission`): `now` (it can start now), `wait`
 * (within the team's limit and the user's cap, but the quota is in use or the devices are busy:
 * a job queues) or `never` (not allowed, beyond the team's limit or the user's cap, or larger
 * than any node).
 */
export type Admission = 'now' | 'wait' | 'never';

/**
 * One pickable (offer, count) line of a team.
 */
export interface IOffer {
  name: string;
  kind: OfferKind;
  label: string;
  description: string;
  /**
   * GPUs or MIG instances per node (always 1 for share and CPU offers).
   */
  count: number;
  /**
   * GPU-equivalents one allocation of this line costs.
   */
  cost: number;
  /**
   * How many of this offer can be placed now.
   */
  free: number;
  /**
   * The verdict on this line for one node. Hubs before admission was reported leave it out;
   * read it through `lineAdmission` (validate.ts), which falls back to `enabled`.
   */
  admission?: Admission;
  /**
   * Whether the line can start now (`admission` is `now`).
   */
  enabled: boolean;
  /**
   * Why not now (empty when `admission` is `now`).
   */
  reason: string;
}

/**
 * One team of the user, its quota figures and what it may request.
 */
export interface ITeamOffers {
  team: string;
  used: number;
  limit: number;
  guarantee: number;
  borrow_limit: number;
  left: number;
  user_used: number;
  user_cap: number | null;
  offers: IOffer[];
}

export interface IOffersReply {
  simulated: boolean;
  inventory: string;
  teams: ITeamOffers[];
}

export type JobState =
  'queued' | 'starting' | 'running' | 'succeeded' | 'failed' | 'cancelled' | 'lost';

/**
 * The states a job never leaves.
 */
export const FINAL_STATES: ReadonlyArray<string> = ['succeeded', 'failed', 'cancelled', 'lost'];

/**
 * Whether a job in this state has ended.
 */
export function isFinal(state: string): boolean {
  return FINAL_STATES.includes(state);
}

export interface IJob {
  id: string;
  name: string;
  owner: string;
  team: string;
  offer: string;
  gpus: number;
  nodes: number;
  ranks: number;
  state: JobState;
  reason: string;
  created: string | null;
  started: string | null;
  finished: string | null;
  exit_codes: { [rank: string]: number };
  queue_position: number | null;
  /**
   * The devices the job holds, or held once it has ended.
   */
  devices: string[];
  time_limit?: number;
  /**
   * Whether this server remembers the job's submission and can submit it again (set by the
   * server extension; absent means no).
   */
  resubmittable?: boolean;
}

export type CellsRequest = 'all' | { upto: number } | { selected: number[] };

export interface ISubmitRequest {
  path: string;
  cells: CellsRequest;
  gpus: number;
  nodes: number;
  offer: string;
  team: string | null;
  time_limit: number;
  name: string;
}

export interface ILogChunk {
  text: string;
  size: number;
  state: string;
}

/**
 * What the idle reclaimer does to a GPU notebook left idle: stop the server, or restart it
 * without a GPU.
 */
export type ReclaimAction = 'stop' | 'cpu';

/**
 * The hub's warning that this server's GPUs will be reclaimed unless they are used.
 */
export interface IReclaimWarning {
  /**
   * When the GPUs are reclaimed (ISO 8601).
   */
  reclaim_at: string;
  action: ReclaimAction;
  /**
   * Why: the GPUs are idle, a share's processes use more GPU memory than the share, or a
   * process of this server uses a GPU it does not hold (that process is stopped).
   */
  reason: 'idle' | 'memory' | 'device';
  /**
   * The hub's full text, for people.
   */
  message: string;
}

export interface IAllocation {
  label: string;
  offer: string;
  team: string;
  simulated: boolean;
  allocation: string;
  /**
   * Since when the GPUs are idle (ISO 8601); null when in use or unknown.
   */
  idle_since: string | null;
  /**
   * Set while the GPUs are about to be reclaimed; null otherwise (or without the hub).
   */
  warning: IReclaimWarning | null;
}

function jobPath(jobId: string): string {
  return `jobs/${encodeURIComponent(jobId)}`;
}

export function getOffers(): Promise<IOffersReply> {
  return requestAPI<IOffersReply>('offers');
}

export function submitJob(request: ISubmitRequest): Promise<IJob> {
  return requestAPI<IJob>('submit', {
    method: 'POST',
    body: JSON.stringify(request)
  });
}

/**
 * Jobs asked for per page (the hub answers at most 500).
 */
export const JOBS_PAGE = 50;

/**
 * One page of the user's jobs, newest first, and the cursor of the next page (null: none).
 */
export interface IJobPage {
  jobs: IJob[];
  next: string | null;
}

/**
 * The page of jobs after the page whose `next` is `cursor` (the newest without one).
 */
export async function listJobs(cursor?: string, limit = JOBS_PAGE): Promise<IJobPage> {
  const query = new URLSearchParams({ limit: String(limit) });
  if (cursor) {
    query.set('cursor', cursor);
  }
  const reply = await requestAPI<Partial<IJobPage>>(`jobs?${query.toString()}`);
  return {
    jobs: Array.isArray(reply?.jobs) ? reply.jobs : [],
    next: typeof reply?.next === 'string' && reply.next ? reply.next : null
  };
}

export function getJob(jobId: string): Promise<IJob> {
  return requestAPI<IJob>(jobPath(jobId));
}

export function cancelJob(jobId: string): Promise<IJob> {
  return requestAPI<IJob>(jobPath(jobId), { method: 'DELETE' });
}

export function resubmitJob(jobId: string): Promise<IJob> {
  return requestAPI<IJob>(`${jobPath(jobId)}/resubmit`, { method: 'POST' });
}

export function getLogs(jobId: string, rank: number, offset: number): Promise<ILogChunk> {
  return requestAPI<ILogChunk>(`${jobPath(jobId)}/logs?rank=${rank}&offset=${offset}`);
}

export function getAllocation(): Promise<IAllocation> {
  return requestAPI<IAllocation>('allocation');
}
