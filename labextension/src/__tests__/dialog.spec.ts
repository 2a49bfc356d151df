import { nullTranslator } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import type { IOffer, IOffersReply, ITeamOffers } from '../api';
import { RunDistributedBody } from '../dialog';
import type { INotebookCells, IRunChoice } from '../validate';

type Line = Partial<IOffer> & Pick<IOffer, 'name' | 'kind'>;

/** An offer line that can start now, with what this one says. */
function line(partial: Line): IOffer {
  return {
    label: partial.name,
    description: '',
    count: 1,
    cost: 0,
    free: 0,
    admission: 'now',
    enabled: true,
    reason: '',
    ...partial
  };
}

/**
 * The lines of one offer for counts 1 to `most`; those above `startable` queue (only that many
 * are free on one node).
 */
function counts(most: number, startable: number, each: (count: number) => Line): IOffer[] {
  return Array.from({ length: most }, (_, i) => {
    const count = i + 1;
    const now = count <= startable;
    return line({
      count,
      admission: now ? 'now' : 'wait',
      enabled: now,
      reason: now ? '' : `only ${startable} free on one node`,
      ...each(count)
    });
  });
}

/** What a hub that does not report admission sends: the line without it. */
function unreported(offer: IOffer): IOffer {
  const copy = { ...offer };
  delete copy.admission;
  return copy;
}

/** A team's offers with its quota: nothing used unless `quota` says so. */
function team(name: string, offers: IOffer[], quota: Partial<ITeamOffers> = {}): ITeamOffers {
  return {
    team: name,
    used: 0,
    limit: 0,
    guarantee: 0,
    borrow_limit: 0,
    left: 0,
    user_used: 0,
    user_cap: null,
    offers,
    ...quota
  };
}

const cpu = line({ name: 'cpu', kind: 'cpu', label: 'CPU only', description: 'No GPU' });
const h100 = (count: number): Line => ({
  name: 'h100',
  kind: 'gpu',
  label: `H100-80GB ×${count}`,
  description: 'Whole H100',
  cost: count,
  free: 2
});

const mounted: RunDistributedBody[] = [];

/**
 * The dialog's body for one team's offers on a pool (`GET offers`' `simulated` and
 * `inventory`), attached to the page (disposed after each test).
 */
function mount(
  offers: ITeamOffers,
  pool: Omit<IOffersReply, 'teams'>,
  choice: IRunChoice,
  cells: INotebookCells = { count: 1, active: 0, selected: [0] }
): RunDistributedBody {
  const body = new RunDistributedBody({
    offers: { ...pool, teams: [offers] },
    choice,
    name: 'train',
    cells,
    trans: nullTranslator.load('gpupool_lab')
  });
  Widget.attach(body, document.body);
  mounted.push(body);
  return body;
}

afterEach(() => {
  for (const body of mounted.splice(0)) {
    body.dispose();
  }
});

function field<T extends HTMLElement>(body: Widget, selector: string): T {
  const node = body.node.querySelector<T>(selector);
  if (node === null) {
    throw new Error(`no ${selector}`);
  }
  return node;
}

function type(input: HTMLInputElement | HTMLSelectElement, value: string): void {
  input.value = value;
  input.dispatchEvent(new Event('input', { bubbles: true }));
}

/** Values typed, in order, into the inputs named: `[['gpus', '2'], ['nodes', '5']]`. */
type Steps = [name: 'gpus' | 'nodes', value: string][];

function typeAll(body: Widget, steps: Steps): void {
  for (const [name, value] of steps) {
    type(field<HTMLInputElement>(body, `input[name="${name}"]`), value);
  }
}

describe('RunDistributedBody', () => {
  const vision = team(
    'vision',
    [
      unreported(cpu),
      // A hub that does not report admission: not enabled reads as never.
      unreported(
        line({
          name: 'mig-3g.40gb',
          kind: 'mig',
          label: 'MIG 3g.40gb',
          description: 'Half an H100',
          cost: 0.5,
          enabled: false,
          reason: 'none free right now'
        })
      ),
      line({
        name: 'mig-2g.20gb',
        kind: 'mig',
        label: 'MIG 2g.20gb',
        description: 'A quarter of an H100',
        cost: 0.25,
        admission: 'wait',
        enabled: false,
        reason: 'none free right now'
      }),
      ...counts(3, 2, h100)
    ],
    { used: 1, limit: 4, guarantee: 3, borrow_limit: 1, left: 3 }
  );
  let body: RunDistributedBody;

  beforeEach(() => {
    body = mount(
      vision,
      { simulated: true, inventory: '2× H100-80GB, MIG' },
      { team: 'vision', offer: 'h100', gpus: 2, nodes: 1, timeLimit: 7200, cells: 'upto' },
      { count: 4, active: 1, selected: [1] }
    );
  });

  it('has the named inputs, pre-filled', () => {
    expect(field<HTMLInputElement>(body, 'input[name="name"]').value).toBe('train');
    expect(field<HTMLSelectElement>(body, 'select[name="team"]').value).toBe('vision');
    expect(field<HTMLSelectElement>(body, 'select[name="offer"]').value).toBe('h100');
    expect(field<HTMLInputElement>(body, 'input[name="gpus"]').value).toBe('2');
    expect(field<HTMLInputElement>(body, 'input[name="nodes"]').value).toBe('1');
    expect(field<HTMLInputElement>(body, 'input[name="time_limit"]').value).toBe('120');
    expect(field<HTMLInputElement>(body, 'input[name="cells"]:checked').value).toBe('upto');
    expect(body.getValue()).toEqual({
      name: 'train',
      team: 'vision',
      offer: 'h100',
      gpus: 2,
      nodes: 1,
      timeLimit: 7200,
      cells: 'upto'
    });
  });

  it('disables offers that can never start, with the reason; marks those that queue', () => {
    const options = Array.from(field<HTMLSelectElement>(body, 'select[name="offer"]').options).map(
      o => [o.value, o.disabled, o.textContent]
    );
    expect(options).toEqual([
      ['cpu', false, 'CPU only'],
      ['mig-3g.40gb', true, 'MIG 3g.40gb — 0 free (none free right now)'],
      ['mig-2g.20gb', false, 'MIG 2g.20gb — 0 free (will queue)'],
      ['h100', false, 'H100-80GB — 2 free']
    ]);
    const queued = body.node.querySelector<HTMLOptionElement>('option[value="mig-2g.20gb"]');
    expect(queued?.title).toBe('A quarter of an H100 — will queue: none free right now');
  });

  it.each<[string, Steps, string]>([
    ['nothing typed', [], ''],
    ['4 GPUs per node', [['gpus', '4']], 'H100-80GB takes 1 to 3 GPUs per node, not 4.'],
    [
      // 10 GPU-eq, beyond the team's limit of 4
      '2 GPUs on 5 nodes',
      [
        ['gpus', '2'],
        ['nodes', '5']
      ],
      'H100-80GB ×2: needs 10 GPU-eq (5 × 2); team vision may hold at most 4.'
    ],
    [
      'valid again after an error',
      [
        ['gpus', '4'],
        ['gpus', '2'],
        ['nodes', '5'],
        ['nodes', '1'],
        ['gpus', '1']
      ],
      ''
    ]
  ])('shows why the form is invalid and marks it for the dialog: %s', (_, steps, message) => {
    const error = field<HTMLElement>(body, '.gpupool-form-error');
    typeAll(body, steps);
    expect(error.textContent).toBe(message);
    expect(error.classList.contains('jp-mod-error')).toBe(message !== '');
  });

  it.each<[string, Steps, string]>([
    ['nothing typed', [], ''],
    ['3 GPUs per node', [['gpus', '3']], 'The job will queue: only 2 free on one node.'],
    [
      // 4 GPU-eq, within the limit of 4 but 3 are left
      '2 GPUs on 2 nodes',
      [
        ['gpus', '2'],
        ['nodes', '2']
      ],
      'The job will queue: needs 4 GPU-eq (2 × 2); team vision has 3 left.'
    ],
    [
      'one node again',
      [
        ['gpus', '2'],
        ['nodes', '2'],
        ['nodes', '1']
      ],
      ''
    ]
  ])('says when the job will queue, and lets it be submitted: %s', (_, steps, notice) => {
    const shown = field<HTMLElement>(body, '.gpupool-form-notice');
    typeAll(body, steps);
    expect(shown.hidden).toBe(notice === '');
    expect(shown.textContent).toBe(notice);
    expect(field<HTMLElement>(body, '.gpupool-form-error').classList).not.toContain('jp-mod-error');
    expect(body.validate()).toBeNull();
  });

  it('relabels the count for CPU and converts minutes to seconds', () => {
    type(field<HTMLSelectElement>(body, 'select[name="offer"]'), 'cpu');
    expect(body.node.textContent).toContain('Processes per node');
    type(field<HTMLInputElement>(body, 'input[name="time_limit"]'), '90');
    expect(body.getValue()).toMatchObject({ offer: 'cpu', timeLimit: 5400 });
  });
});

describe('RunDistributedBody for a user in no team', () => {
  it('says CPU only, not a quota of 0 of 0', () => {
    const body = mount(
      team('everyone', [cpu]),
      { simulated: false, inventory: '4× H100-80GB' },
      { team: 'everyone', offer: 'cpu', gpus: 2, nodes: 1, timeLimit: 3600, cells: 'all' }
    );
    expect(field<HTMLSelectElement>(body, 'select[name="team"]').options[0].textContent).toBe(
      'no team (CPU only)'
    );
    expect(field<HTMLElement>(body, '.gpupool-quota').textContent).toBe(
      'CPU only (you are in no team)'
    );
    expect(body.node.textContent).not.toMatch(/0 of 0|GPU-eq/);
    expect(body.node.textContent).not.toMatch(/waiting for GPUs/i);
    expect(body.validate()).toBeNull();
  });
});

describe('RunDistributedBody with MIG instances and shares', () => {
  const edge = team(
    'edge',
    [
      line({ name: 'cpu', kind: 'cpu', label: 'CPU only' }),
      line({
        name: 'share-6gb',
        kind: 'share',
        label: '6 GB share of RTX3090-24GB',
        description: 'A quarter of an RTX 3090',
        cost: 0.25,
        free: 3
      }),
      ...counts(3, 2, count => ({
        name: 'mig-1g.10gb',
        kind: 'mig',
        label: `MIG 1g.10gb ×${count}`,
        description: 'An eighth of an H100',
        cost: 0.125 * count,
        free: 2
      })),
      ...counts(2, 2, h100)
    ],
    { limit: 4, guarantee: 4, left: 4 }
  );
  let body: RunDistributedBody;

  beforeEach(() => {
    body = mount(
      edge,
      { simulated: true, inventory: 'H100 with MIG, RTX 3090' },
      { team: 'edge', offer: 'h100', gpus: 2, nodes: 1, timeLimit: 3600, cells: 'all' }
    );
  });

  const gpus = () => field<HTMLInputElement>(body, 'input[name="gpus"]');
  const gpusLabel = () => field<HTMLLabelElement>(body, `label[for="${gpus().id}"]`).textContent;
  const hint = () => field<HTMLElement>(body, '.gpupool-offer-hint').textContent;
  const error = () => field<HTMLElement>(body, '.gpupool-form-error').textContent;

  it('lists each offer once, without its count', () => {
    const options = Array.from(field<HTMLSelectElement>(body, 'select[name="offer"]').options);
    expect(options.map(o => o.textContent)).toEqual([
      'CPU only',
      '6 GB share of RTX3090-24GB — 3 free',
      'MIG 1g.10gb — 2 free',
      'H100-80GB — 2 free'
    ]);
  });

  it('keeps the number of MIG instances, says how many can start, one rank on each', () => {
    type(field<HTMLSelectElement>(body, 'select[name="offer"]'), 'mig-1g.10gb');
    expect(gpus().value).toBe('2');
    expect(gpus().max).toBe('3');
    expect(gpus().disabled).toBe(false);
    expect(gpusLabel()).toBe('MIG instances per node');
    expect(hint()).toBe(
      'An eighth of an H100 · 2 free now; up to 2 instances per node can start now · ' +
        'one rank per instance; several per node talk over gloo (NCCL does not span MIG ' +
        'instances)'
    );
    expect(error()).toBe('');
    expect(body.getValue()).toMatchObject({ offer: 'mig-1g.10gb', gpus: 2 });

    type(gpus(), '3');
    expect(body.validate()).toBeNull();
    expect(field<HTMLElement>(body, '.gpupool-form-notice').textContent).toBe(
      'The job will queue: only 2 free on one node.'
    );
    type(gpus(), '4');
    expect(error()).toBe('MIG 1g.10gb takes 1 to 3 MIG instances per node, not 4.');
  });

  it('runs one process per node on a share: the number is fixed at 1', () => {
    type(field<HTMLSelectElement>(body, 'select[name="offer"]'), 'share-6gb');
    expect(gpus().value).toBe('1');
    expect(gpus().disabled).toBe(true);
    expect(gpusLabel()).toBe('Processes per node');
    expect(hint()).toBe(
      'A quarter of an RTX 3090 · 3 free now; one process per node, on its share of one GPU'
    );
    expect(body.validate()).toBeNull();
    expect(body.getValue()).toMatchObject({ offer: 'share-6gb', gpus: 1 });

    type(field<HTMLSelectElement>(body, 'select[name="offer"]'), 'h100');
    expect(gpus().disabled).toBe(false);
    expect(gpusLabel()).toBe('GPUs per node');
  });
});
