/**
 * The "Run distributed" form's rules, as pure functions of the form and the offers reply.
 *
 * The hub decides in the end (a hand-made request gets the same answer); these checks only
 * keep the user from submitting what `GET offers` already says can never be granted, and say
 * when a job would queue instead of starting now.
 */
import type {
  Admission,
  CellsRequest,
  IOffer,
  IOffersReply,
  ISubmitRequest,
  ITeamOffers,
  OfferKind
} from './api';
import { formatGpuEq } from './format';

export type CellsMode = 'all' | 'upto' | 'selected';

export const CELLS_MODES: ReadonlyArray<CellsMode> = ['all', 'upto', 'selected'];

/**
 * What the user picks in the dialog (and what is remembered for next time).
 */
export interface IRunChoice {
  team: string;
  offer: string;
  /**
   * GPUs or MIG instances per node (processes per node for a CPU offer; always 1 for a share).
   */
  gpus: number;
  nodes: number;
  /**
   * Seconds.
   */
  timeLimit: number;
  cells: CellsMode;
}

/**
 * The dialog's value: the choice and the job's name.
 */
export interface IRunForm extends IRunChoice {
  name: string;
}

/**
 * The notebook's cells at the time of the dialog.
 */
export interface INotebookCells {
  count: number;
  /**
   * Index of the active cell (-1 when none).
   */
  active: number;
  /**
   * Indexes of the selected cells (the active cell included), ascending.
   */
  selected: number[];
}

export const MAX_GPUS_PER_NODE = 64;
export const MAX_NODES = 64;
export const MIN_TIME_LIMIT = 60;
export const DEFAULT_TIME_LIMIT = 3600;

/**
 * The team a choice names; the only team when it names none.
 */
export function findTeam(offers: IOffersReply, team: string): ITeamOffers | undefined {
  if (!team) {
    return offers.teams.length === 1 ? offers.teams[0] : undefined;
  }
  return offers.teams.find(t => t.team === team);
}

/**
 * The lines of one offer in a team (one per count), in the server's order.
 */
export function offerEntries(team: ITeamOffers, offer: string): IOffer[] {
  return team.offers.filter(o => o.name === offer);
}

/**
 * The distinct offer names of a team, in the server's order.
 */
export function offerNames(team: ITeamOffers): string[] {
  const names: string[] = [];
  for (const o of team.offers) {
    if (!names.includes(o.name)) {
      names.push(o.name);
    }
  }
  return names;
}

/**
 * Whether a request of this kind names how many per node (whole GPUs, MIG instances): the hub
 * lists one line per count and a job runs one rank on each. Shared with the notebook side's
 * Python (`gpupool_lab.options.is_counted`; the table in `__tests__/offer_kinds.json`).
 */
export function isCounted(kind: string): boolean {
  return kind === 'gpu' || kind === 'mig';
}

/**
 * Whether a request of this kind takes exactly one per node: a share of a GPU (a share job runs
 * one process per node), and any kind this version does not know (the hub takes a count of 1
 * for it). A CPU offer runs any number of processes per node.
 */
export function isOnePerNode(kind: string): boolean {
  return !isCounted(kind) && kind !== 'cpu';
}

/**
 * What the number per node counts, for an offer of this kind.
 */
export function perNodeLabel(kind: string): string {
  switch (kind) {
    case 'gpu':
      return 'GPUs per node';
    case 'mig':
      return 'MIG instances per node';
    default:
      return 'Processes per node';
  }
}

/**
 * Whether a job of `gpus` per node is judged by this line: a CPU line takes any number of
 * processes, any other line its own count (a share's is 1).
 */
export function lineFits(entry: IOffer, gpus: number): boolean {
  return entry.kind === 'cpu' || entry.count === gpus;
}

/**
 * An offer's label without its count ("H100-80GB ×2", "MIG 1g.10gb ×2" or "2× H100-80GB" →
 * "H100-80GB", "MIG 1g.10gb").
 */
export function baseLabel(entry: IOffer): string {
  if (!isCounted(entry.kind)) {
    return entry.label;
  }
  return entry.label.replace(/\s*×\s*\d+$/, '').replace(/^\d+\s*×\s*/, '');
}

/**
 * The line that a number per node of this offer maps to.
 */
export function entryFor(entries: IOffer[], gpus: number): IOffer | undefined {
  return entries.find(e => lineFits(e, gpus));
}

/**
 * The most per node an offer takes: its largest count, 1 for a share, any for CPU.
 */
export function maxPerNode(entries: IOffer[]): number {
  if (entries.length === 0) {
    return 1;
  }
  const kind = entries[0].kind;
  if (isCounted(kind)) {
    return Math.max(...entries.map(e => e.count));
  }
  return kind === 'cpu' ? MAX_GPUS_PER_NODE : 1;
}

function isWhole(value: number, low: number, high: number): boolean {
  return Number.isInteger(value) && value >= low && value <= high;
}

function sentence(text: string): string {
  return /[.!?]$/.test(text) ? text : `${text}.`;
}

/**
 * A verdict with the reason, a phrase (empty for `now`).
 */
export interface IAdmission {
  verdict: Admission;
  reason: string;
}

const VERDICTS: ReadonlyArray<string> = ['now', 'wait', 'never'];

/**
 * The hub's verdict on one line of an offer, for one node. A hub that does not report
 * `admission` is read by `enabled`: a line that cannot start now is refused, as before.
 */
export function lineAdmission(entry: IOffer): IAdmission {
  const given = entry.admission;
  const verdict: Admission =
    given !== undefined && VERDICTS.includes(given) ? given : entry.enabled ? 'now' : 'never';
  return { verdict, reason: verdict === 'now' ? '' : entry.reason || 'not available now' };
}

function milli(value: number): number {
  return Math.round(value * 1000);
}

/**
 * The verdict on one line of an offer on `nodes` nodes. One node: the hub's verdict on the line,
 * word for word. More: the line's cost multiplied by the nodes against the team's figures, as
 * the hub's rule does: more than the team's limit or the user's cap can never start, more than
 * what is left of either waits for it; otherwise the line's own verdict.
 */
export function admitChoice(team: ITeamOffers, entry: IOffer, nodes: number): IAdmission {
  const line = lineAdmission(entry);
  const needMilli = milli(entry.cost) * nodes;
  if (line.verdict === 'never' || nodes <= 1 || needMilli <= 0) {
    return line;
  }
  const needs = `needs ${formatGpuEq(needMilli / 1000)} GPU-eq (${nodes} × ${formatGpuEq(entry.cost)})`;
  const cap = team.user_cap ?? null;
  if (needMilli > milli(team.limit)) {
    return {
      verdict: 'never',
      reason: `${needs}; team ${team.team} may hold at most ${formatGpuEq(team.limit)}`
    };
  }
  if (cap !== null && needMilli > milli(cap)) {
    return {
      verdict: 'never',
      reason: `${needs}; your cap in team ${team.team} is ${formatGpuEq(cap)}`
    };
  }
  if (needMilli > milli(team.left)) {
    const left = Math.max(0, milli(team.left)) / 1000;
    return { verdict: 'wait', reason: `${needs}; team ${team.team} has ${formatGpuEq(left)} left` };
  }
  if (cap !== null && needMilli > milli(cap) - milli(team.user_used)) {
    const mine = Math.max(0, milli(cap) - milli(team.user_used)) / 1000;
    return {
      verdict: 'wait',
      reason: `${needs}; you have ${formatGpuEq(mine)} of your cap left`
    };
  }
  return line;
}

/**
 * The verdict on a choice, or `null` when the choice names no team, offer line or node count
 * that `GET offers` knows (`validateChoice` says what is wrong then).
 */
export function choiceAdmission(form: IRunChoice, offers: IOffersReply): IAdmission | null {
  const team = findTeam(offers, form.team);
  if (team === undefined || !isWhole(form.nodes, 1, MAX_NODES)) {
    return null;
  }
  const entry = entryFor(offerEntries(team, form.offer), form.gpus);
  return entry === undefined ? null : admitChoice(team, entry, form.nodes);
}

/**
 * What the dialog says about a job that would wait: "The job will queue: <reason>."
 */
export function queueNotice(admission: IAdmission | null): string {
  return admission?.verdict === 'wait' ? sentence(`The job will queue: ${admission.reason}`) : '';
}

/**
 * Why a choice cannot be submitted, or `null` when it can (it may still have to wait in the
 * queue: see `choiceAdmission`).
 *
 * @param form - the dialog's values
 * @param offers - the `GET offers` reply the dialog was built from
 * @param cells - the notebook's cells (skips the cell checks when omitted)
 */
export function validateChoice(
  form: IRunChoice,
  offers: IOffersReply,
  cells?: INotebookCells
): string | null {
  if (offers.teams.length === 0) {
    return 'The pool lists no team for you, so there is nothing you may request.';
  }
  const team = findTeam(offers, form.team);
  const teamNames = offers.teams.map(t => t.team).join(', ');
  if (team === undefined) {
    return form.team
      ? `You are not in team ${form.team}; your teams: ${teamNames}.`
      : `Choose a team: ${teamNames}.`;
  }

  const entries = offerEntries(team, form.offer);
  if (entries.length === 0) {
    if (!form.offer) {
      return 'Choose an offer.';
    }
    const allowed = offerNames(team).join(', ') || 'none';
    return `Team ${team.team} may not request ${form.offer}; allowed: ${allowed}.`;
  }
  const kind = entries[0].kind;
  const label = baseLabel(entries[0]);

  const what = perNodeLabel(kind);
  if (!isWhole(form.gpus, 1, MAX_GPUS_PER_NODE)) {
    return `${what} must be a whole number from 1 to ${MAX_GPUS_PER_NODE}.`;
  }
  if (!isWhole(form.nodes, 1, MAX_NODES)) {
    return `Nodes must be a whole number from 1 to ${MAX_NODES}.`;
  }

  const entry = entryFor(entries, form.gpus);
  if (entry === undefined && isOnePerNode(kind)) {
    return `${label} runs 1 process per node, not ${form.gpus}.`;
  }
  if (entry === undefined) {
    return `${label} takes 1 to ${maxPerNode(entries)} ${what}, not ${form.gpus}.`;
  }
  const admission = admitChoice(team, entry, form.nodes);
  if (admission.verdict === 'never') {
    return sentence(`${entry.label}: ${admission.reason}`);
  }

  if (!Number.isInteger(form.timeLimit) || form.timeLimit < MIN_TIME_LIMIT) {
    return 'The time limit must be at least 1 minute.';
  }

  if (!CELLS_MODES.includes(form.cells)) {
    return 'Choose which cells to run.';
  }
  if (cells !== undefined) {
    if (cells.count === 0) {
      return 'The notebook has no cells to run.';
    }
    if (form.cells === 'upto' && (cells.active < 0 || cells.active >= cells.count)) {
      return 'There is no active cell to run up to.';
    }
    if (form.cells === 'selected' && cells.selected.length === 0) {
      return 'No cells are selected.';
    }
  }
  return null;
}

/**
 * A remembered choice read back from storage, keeping only well-typed fields.
 */
export function parseChoice(value: unknown): Partial<IRunChoice> | null {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    return null;
  }
  const v = value as { [key: string]: unknown };
  const out: Partial<IRunChoice> = {};
  if (typeof v.team === 'string') {
    out.team = v.team;
  }
  if (typeof v.offer === 'string') {
    out.offer = v.offer;
  }
  for (const key of ['gpus', 'nodes', 'timeLimit'] as const) {
    const n = v[key];
    if (typeof n === 'number' && Number.isFinite(n)) {
      out[key] = n;
    }
  }
  if (typeof v.cells === 'string' && (CELLS_MODES as ReadonlyArray<string>).includes(v.cells)) {
    out.cells = v.cells as CellsMode;
  }
  return out;
}

/**
 * The kinds a default offer is looked for in, first to last (the notebook side's
 * `gpupool_lab.options.KIND_PREFERENCE`).
 */
export const KIND_PREFERENCE: ReadonlyArray<OfferKind> = ['gpu', 'mig', 'share', 'cpu'];

/**
 * The dialog's first values: the last choice where it is still available, otherwise the first
 * thing that can start now (whole GPUs first, then MIG, then a share, then CPU). A counted
 * offer keeps the number per node where a line of it is available, else the most below it
 * (else the least); a share takes 1.
 */
export function initialChoice(offers: IOffersReply, last?: Partial<IRunChoice> | null): IRunChoice {
  const prev = last ?? {};
  const nodes = isWhole(prev.nodes ?? NaN, 1, MAX_NODES) ? (prev.nodes as number) : 1;
  const timeLimit =
    Number.isInteger(prev.timeLimit) && (prev.timeLimit as number) >= MIN_TIME_LIMIT
      ? (prev.timeLimit as number)
      : DEFAULT_TIME_LIMIT;
  const cells = prev.cells && CELLS_MODES.includes(prev.cells) ? prev.cells : 'all';
  const wantGpus = isWhole(prev.gpus ?? NaN, 1, MAX_GPUS_PER_NODE) ? (prev.gpus as number) : 1;

  const team = offers.teams.find(t => t.team === prev.team) ?? offers.teams[0];
  if (team === undefined) {
    return { team: '', offer: '', gpus: wantGpus, nodes, timeLimit, cells };
  }

  // What starts now first, then what would queue, then anything; at each level the last
  // choice before the other offers.
  const rank = (o: IOffer) => VERDICTS.indexOf(lineAdmission(o).verdict);
  const pick = (level: number): string | undefined => {
    const usable = (o: IOffer) => rank(o) <= level;
    if (prev.offer !== undefined && team.offers.some(o => o.name === prev.offer && usable(o))) {
      return prev.offer;
    }
    for (const kind of KIND_PREFERENCE) {
      const found = team.offers.find(o => o.kind === kind && usable(o));
      if (found !== undefined) {
        return found.name;
      }
    }
    return undefined;
  };
  let level = 0;
  let offer = pick(level);
  while (offer === undefined && level < 2) {
    offer = pick(++level);
  }
  offer = offer ?? '';

  const entries = offerEntries(team, offer);
  const kind = entries.length > 0 ? entries[0].kind : 'cpu';
  let gpus = wantGpus;
  if (isOnePerNode(kind)) {
    gpus = 1;
  } else if (isCounted(kind)) {
    const counts = entries.filter(e => rank(e) <= level).map(e => e.count);
    if (!counts.includes(wantGpus)) {
      const below = counts.filter(c => c <= wantGpus);
      gpus = below.length > 0 ? Math.max(...below) : counts.length > 0 ? Math.min(...counts) : 1;
    }
  }
  return { team: team.team, offer, gpus, nodes, timeLimit, cells };
}

/**
 * The `POST submit` body for a validated form.
 */
export function submission(path: string, form: IRunForm, cells: INotebookCells): ISubmitRequest {
  let chosen: CellsRequest = 'all';
  if (form.cells === 'upto') {
    chosen = { upto: cells.active };
  } else if (form.cells === 'selected') {
    chosen = { selected: [...cells.selected] };
  }
  return {
    path,
    cells: chosen,
    gpus: form.gpus,
    nodes: form.nodes,
    offer: form.offer,
    team: form.team || null,
    time_limit: form.timeLimit,
    name: form.name
  };
}
