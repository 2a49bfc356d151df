import type { Admission, IOffer, IOffersReply, ITeamOffers, OfferKind } from '../api';
import {
  admitChoice,
  baseLabel,
  choiceAdmission,
  entryFor,
  INotebookCells,
  initialChoice,
  IRunChoice,
  isCounted,
  isOnePerNode,
  KIND_PREFERENCE,
  lineAdmission,
  lineFits,
  maxPerNode,
  offerEntries,
  parseChoice,
  perNodeLabel,
  queueNotice,
  submission,
  validateChoice
} from '../validate';
import kindTable from './offer_kinds.json';

function offer(partial: Partial<IOffer> & { name: string }): IOffer {
  return {
    kind: 'gpu',
    label: partial.name,
    description: '',
    count: 1,
    cost: 1,
    free: 4,
    admission: 'now',
    enabled: true,
    reason: '',
    ...partial
  };
}

/**
 * A line the hub judged: `enabled` follows the verdict, as in the offers document.
 */
function judged(admission: Admission, reason = ''): Partial<IOffer> {
  return { admission, enabled: admission === 'now', reason };
}

function h100(count: number, admission: Admission = 'now', reason = ''): IOffer {
  return offer({
    name: 'h100',
    kind: 'gpu',
    label: `H100-80GB ×${count}`,
    count,
    cost: count,
    free: 2,
    ...judged(admission, reason)
  });
}

function team(partial: Partial<ITeamOffers> & { team: string }): ITeamOffers {
  return {
    used: 0,
    limit: 3,
    guarantee: 2,
    borrow_limit: 1,
    left: 3,
    user_used: 0,
    user_cap: null,
    offers: [],
    ...partial
  };
}

const vision = team({
  team: 'vision',
  used: 1,
  limit: 4,
  left: 3,
  offers: [
    offer({ name: 'cpu', kind: 'cpu', label: 'CPU only', cost: 0, free: 0 }),
    offer({
      name: 'mig-3g.40gb',
      kind: 'mig',
      label: 'MIG 3g.40gb',
      cost: 0.5,
      free: 0,
      ...judged('wait', 'none free right now')
    }),
    h100(1),
    h100(2),
    h100(3, 'wait', 'only 2 free on one node'),
    h100(4, 'wait', 'needs 4 GPU-eq; team vision has 3 left')
  ]
});

const nlp = team({
  team: 'nlp',
  limit: 2,
  left: 2,
  user_cap: 1,
  user_used: 0.5,
  offers: [
    offer({ name: 'cpu', kind: 'cpu', label: 'CPU only', cost: 0 }),
    offer({ name: 'mig-1g.10gb', kind: 'mig', label: 'MIG 1g.10gb', cost: 0.125, free: 7 }),
    offer({
      name: 'mig-7g.80gb',
      kind: 'mig',
      label: 'MIG 7g.80gb',
      cost: 1,
      free: 0,
      ...judged('never', 'this pool holds none of mig-7g.80gb on one node')
    })
  ]
});

const offers: IOffersReply = { simulated: true, inventory: '2× H100-80GB', teams: [vision, nlp] };

function mig1g(count: number, admission: Admission = 'now', reason = ''): IOffer {
  return offer({
    name: 'mig-1g.10gb',
    kind: 'mig',
    label: `MIG 1g.10gb ×${count}`,
    count,
    cost: 0.125 * count,
    free: 2,
    ...judged(admission, reason)
  });
}

const quarter = offer({
  name: 'share-6gb',
  kind: 'share',
  label: '6 GB share of RTX3090-24GB',
  cost: 0.25,
  free: 3
});

/**
 * A team with MIG instances up to 3 per node (2 free) and a share of a GPU.
 */
const edge = team({
  team: 'edge',
  limit: 2,
  left: 2,
  offers: [
    offer({ name: 'cpu', kind: 'cpu', label: 'CPU only', cost: 0 }),
    quarter,
    mig1g(1),
    mig1g(2),
    mig1g(3, 'wait', 'only 2 free on one node')
  ]
});

const edgeOffers: IOffersReply = { ...offers, teams: [edge] };

const cells: INotebookCells = { count: 5, active: 2, selected: [1, 2] };

function choice(partial: Partial<IRunChoice> = {}): IRunChoice {
  return {
    team: 'vision',
    offer: 'h100',
    gpus: 2,
    nodes: 1,
    timeLimit: 3600,
    cells: 'all',
    ...partial
  };
}

describe('offer kinds (the table the Python side shares)', () => {
  it('says which kinds are counted, which take one per node, and what the number is', () => {
    for (const [kind, rule] of Object.entries(kindTable.kinds)) {
      expect([kind, isCounted(kind), isOnePerNode(kind), perNodeLabel(kind)]).toEqual([
        kind,
        rule.counted,
        rule.onePerNode,
        rule.perNode
      ]);
    }
    expect(KIND_PREFERENCE).toEqual(kindTable.preference);
  });

  it('fits a number per node to a line', () => {
    for (const row of kindTable.fits) {
      const line = offer({ name: 'x', kind: row.kind as OfferKind, count: row.count });
      expect([row, lineFits(line, row.gpus)]).toEqual([row, row.fits]);
    }
  });

  it('counts MIG instances like whole GPUs: a line per count', () => {
    const lines = offerEntries(edge, 'mig-1g.10gb');
    expect(maxPerNode(lines)).toBe(3);
    expect(entryFor(lines, 2)).toBe(lines[1]);
    expect(entryFor(lines, 4)).toBeUndefined();
    expect(baseLabel(lines[1])).toBe('MIG 1g.10gb');
    expect(baseLabel(h100(2))).toBe('H100-80GB');
  });

  it('takes one share per node', () => {
    expect(maxPerNode([quarter])).toBe(1);
    expect(entryFor([quarter], 1)).toBe(quarter);
    expect(entryFor([quarter], 2)).toBeUndefined();
    expect(baseLabel(quarter)).toBe('6 GB share of RTX3090-24GB');
  });
});

describe('admission', () => {
  const admission = (partial: Partial<IRunChoice>) => choiceAdmission(choice(partial), offers);

  it('lets a job that can start now be submitted, with no notice', () => {
    expect(admission({ gpus: 2 })).toEqual({ verdict: 'now', reason: '' });
    expect(validateChoice(choice({ gpus: 2 }), offers, cells)).toBeNull();
    expect(queueNotice(admission({ gpus: 2 }))).toBe('');
  });

  it('lets a job that would wait be submitted, saying why it will queue', () => {
    expect(admission({ gpus: 3 })).toEqual({ verdict: 'wait', reason: 'only 2 free on one node' });
    expect(validateChoice(choice({ gpus: 3 }), offers, cells)).toBeNull();
    expect(queueNotice(admission({ gpus: 3 }))).toBe(
      'The job will queue: only 2 free on one node.'
    );
    const mig = choice({ offer: 'mig-3g.40gb', gpus: 1 });
    expect(validateChoice(mig, offers, cells)).toBeNull();
    expect(queueNotice(choiceAdmission(mig, offers))).toBe(
      'The job will queue: none free right now.'
    );
  });

  it('refuses a job that can never start, with the reason', () => {
    const never = choice({ team: 'nlp', offer: 'mig-7g.80gb', gpus: 1 });
    expect(choiceAdmission(never, offers)).toEqual({
      verdict: 'never',
      reason: 'this pool holds none of mig-7g.80gb on one node'
    });
    expect(validateChoice(never, offers, cells)).toBe(
      'MIG 7g.80gb: this pool holds none of mig-7g.80gb on one node.'
    );
    expect(queueNotice(choiceAdmission(never, offers))).toBe('');
  });

  it("multiplies the line's cost by the nodes: beyond what is left waits", () => {
    // vision: limit 4, 3 left.
    expect(admission({ gpus: 1, nodes: 3 })).toEqual({ verdict: 'now', reason: '' });
    expect(admission({ gpus: 2, nodes: 2 })).toEqual({
      verdict: 'wait',
      reason: 'needs 4 GPU-eq (2 × 2); team vision has 3 left'
    });
    expect(validateChoice(choice({ gpus: 2, nodes: 2 }), offers, cells)).toBeNull();
    // nlp: cap 1, the user holds 0.5; 5 × 0.125 = 0.625.
    const mig = { team: 'nlp', offer: 'mig-1g.10gb', gpus: 1 };
    expect(admission({ ...mig, nodes: 4 })?.verdict).toBe('now');
    expect(admission({ ...mig, nodes: 5 })).toEqual({
      verdict: 'wait',
      reason: 'needs 0.625 GPU-eq (5 × 0.125); you have 0.5 of your cap left'
    });
  });

  it("multiplies the line's cost by the nodes: beyond the limit or the cap never starts", () => {
    expect(admission({ gpus: 2, nodes: 3 })).toEqual({
      verdict: 'never',
      reason: 'needs 6 GPU-eq (3 × 2); team vision may hold at most 4'
    });
    expect(validateChoice(choice({ gpus: 2, nodes: 3 }), offers, cells)).toBe(
      'H100-80GB ×2: needs 6 GPU-eq (3 × 2); team vision may hold at most 4.'
    );
    // nlp: limit 2, cap 1; 9 × 0.125 = 1.125.
    const mig = choice({ team: 'nlp', offer: 'mig-1g.10gb', gpus: 1, nodes: 9 });
    expect(validateChoice(mig, offers, cells)).toBe(
      'MIG 1g.10gb: needs 1.125 GPU-eq (9 × 0.125); your cap in team nlp is 1.'
    );
  });

  it("takes the hub's verdict on one node word for word", () => {
    const full = { ...vision, used: 4, left: 0 };
    const line = offer({ name: 'h100', cost: 1, ...judged('wait', 'team vision uses 4 of 4') });
    expect(admitChoice(full, line, 1)).toEqual({
      verdict: 'wait',
      reason: 'team vision uses 4 of 4'
    });
    expect(admitChoice(full, line, 2)).toEqual({
      verdict: 'wait',
      reason: 'needs 2 GPU-eq (2 × 1); team vision has 0 left'
    });
  });

  it('never lets more nodes turn a refused line into one that waits or starts', () => {
    const line = offer({ name: 'x', cost: 0.5, ...judged('never', 'not allowed') });
    expect(admitChoice(vision, line, 2)).toEqual({ verdict: 'never', reason: 'not allowed' });
  });

  it('costs nothing for CPU, whatever the nodes', () => {
    const everyone = team({ team: 'everyone', limit: 0, left: 0, guarantee: 0, borrow_limit: 0 });
    const cpu = offer({ name: 'cpu', kind: 'cpu', label: 'CPU only', cost: 0 });
    expect(admitChoice(everyone, cpu, 8)).toEqual({ verdict: 'now', reason: '' });
  });

  it('reads a hub that does not report admission by enabled', () => {
    const old = (enabled: boolean, reason = '') => {
      const line = offer({ name: 'h100', enabled, reason });
      delete line.admission;
      return line;
    };
    expect(lineAdmission(old(true))).toEqual({ verdict: 'now', reason: '' });
    expect(lineAdmission(old(false, 'none free right now'))).toEqual({
      verdict: 'never',
      reason: 'none free right now'
    });
    expect(lineAdmission(old(false))).toEqual({ verdict: 'never', reason: 'not available now' });
    const odd = { ...old(false, 'later'), admission: 'someday' as Admission };
    expect(lineAdmission(odd).verdict).toBe('never');
  });
});

describe('validateChoice', () => {
  it('accepts what the offers say can start now', () => {
    expect(validateChoice(choice(), offers, cells)).toBeNull();
    expect(validateChoice(choice({ gpus: 1, nodes: 3 }), offers, cells)).toBeNull();
    expect(validateChoice(choice({ offer: 'cpu', gpus: 8, nodes: 2 }), offers, cells)).toBeNull();
    expect(
      validateChoice(choice({ team: 'nlp', offer: 'mig-1g.10gb', gpus: 1, nodes: 4 }), offers)
    ).toBeNull();
  });

  it('refuses counts the offer does not take', () => {
    expect(validateChoice(choice({ gpus: 9 }), offers, cells)).toBe(
      'H100-80GB takes 1 to 4 GPUs per node, not 9.'
    );
    expect(
      validateChoice(choice({ team: 'nlp', offer: 'mig-1g.10gb', gpus: 2 }), offers, cells)
    ).toBe('MIG 1g.10gb takes 1 to 1 MIG instances per node, not 2.');
  });

  it('takes several MIG instances per node where the offer lists them', () => {
    const mig = (gpus: number, nodes = 1) =>
      choice({ team: 'edge', offer: 'mig-1g.10gb', gpus, nodes });
    expect(validateChoice(mig(2), edgeOffers, cells)).toBeNull();
    expect(choiceAdmission(mig(2), edgeOffers)).toEqual({ verdict: 'now', reason: '' });
    expect(validateChoice(mig(3), edgeOffers, cells)).toBeNull();
    expect(queueNotice(choiceAdmission(mig(3), edgeOffers))).toBe(
      'The job will queue: only 2 free on one node.'
    );
    expect(validateChoice(mig(4), edgeOffers, cells)).toBe(
      'MIG 1g.10gb takes 1 to 3 MIG instances per node, not 4.'
    );
    // edge: limit 2; 0.375 on each of 9 nodes.
    expect(validateChoice(mig(3, 9), edgeOffers, cells)).toBe(
      'MIG 1g.10gb ×3: needs 3.375 GPU-eq (9 × 0.375); team edge may hold at most 2.'
    );
    expect(validateChoice(mig(0), edgeOffers)).toBe(
      'MIG instances per node must be a whole number from 1 to 64.'
    );
  });

  it('runs one process per node on a share', () => {
    const share = (gpus: number) => choice({ team: 'edge', offer: 'share-6gb', gpus });
    expect(validateChoice(share(1), edgeOffers, cells)).toBeNull();
    expect(validateChoice(share(2), edgeOffers, cells)).toBe(
      '6 GB share of RTX3090-24GB runs 1 process per node, not 2.'
    );
  });

  it('checks whole numbers in range', () => {
    expect(validateChoice(choice({ gpus: 0 }), offers)).toBe(
      'GPUs per node must be a whole number from 1 to 64.'
    );
    expect(validateChoice(choice({ gpus: 1.5 }), offers)).toBe(
      'GPUs per node must be a whole number from 1 to 64.'
    );
    expect(validateChoice(choice({ offer: 'cpu', gpus: NaN }), offers)).toBe(
      'Processes per node must be a whole number from 1 to 64.'
    );
    expect(validateChoice(choice({ nodes: 0 }), offers)).toBe(
      'Nodes must be a whole number from 1 to 64.'
    );
    expect(validateChoice(choice({ nodes: 65 }), offers)).toBe(
      'Nodes must be a whole number from 1 to 64.'
    );
  });

  it('knows teams and offers', () => {
    expect(validateChoice(choice({ team: 'audio' }), offers)).toBe(
      'You are not in team audio; your teams: vision, nlp.'
    );
    expect(validateChoice(choice({ team: '' }), offers)).toBe('Choose a team: vision, nlp.');
    expect(validateChoice(choice({ team: 'nlp', offer: 'h100' }), offers)).toBe(
      'Team nlp may not request h100; allowed: cpu, mig-1g.10gb, mig-7g.80gb.'
    );
    expect(validateChoice(choice({ offer: '' }), offers)).toBe('Choose an offer.');
    expect(validateChoice(choice(), { ...offers, teams: [] })).toBe(
      'The pool lists no team for you, so there is nothing you may request.'
    );
  });

  it('takes the only team when none is named', () => {
    const one = { ...offers, teams: [nlp] };
    expect(validateChoice(choice({ team: '', offer: 'cpu', gpus: 2 }), one)).toBeNull();
  });

  it('checks the time limit', () => {
    expect(validateChoice(choice({ timeLimit: 59 }), offers)).toBe(
      'The time limit must be at least 1 minute.'
    );
    expect(validateChoice(choice({ timeLimit: NaN }), offers)).toBe(
      'The time limit must be at least 1 minute.'
    );
  });

  it('checks the cells against the notebook', () => {
    expect(validateChoice(choice({ cells: 'upto' }), offers, cells)).toBeNull();
    expect(validateChoice(choice({ cells: 'selected' }), offers, cells)).toBeNull();
    expect(validateChoice(choice({ cells: 'selected' }), offers, { ...cells, selected: [] })).toBe(
      'No cells are selected.'
    );
    expect(validateChoice(choice({ cells: 'upto' }), offers, { ...cells, active: -1 })).toBe(
      'There is no active cell to run up to.'
    );
    expect(validateChoice(choice(), offers, { count: 0, active: -1, selected: [] })).toBe(
      'The notebook has no cells to run.'
    );
    expect(validateChoice(choice({ cells: 'some' as never }), offers, cells)).toBe(
      'Choose which cells to run.'
    );
  });
});

describe('initialChoice', () => {
  it('keeps the last choice while it is available', () => {
    const last = {
      team: 'vision',
      offer: 'h100',
      gpus: 2,
      nodes: 2,
      timeLimit: 7200,
      cells: 'upto' as const
    };
    expect(initialChoice(offers, last)).toEqual(last);
  });

  it('falls back to what can start now, whole GPUs first', () => {
    expect(initialChoice(offers, null)).toEqual({
      team: 'vision',
      offer: 'h100',
      gpus: 1,
      nodes: 1,
      timeLimit: 3600,
      cells: 'all'
    });
    // 4 GPUs cannot start now: the most that can, below it.
    expect(initialChoice(offers, { team: 'vision', offer: 'h100', gpus: 4 }).gpus).toBe(2);
    // MIG 3g.40gb has none free: another offer.
    expect(initialChoice(offers, { team: 'vision', offer: 'mig-3g.40gb' }).offer).toBe('h100');
    // nlp has no whole GPUs: MIG before CPU, one instance.
    expect(initialChoice(offers, { team: 'nlp', gpus: 4 })).toMatchObject({
      team: 'nlp',
      offer: 'mig-1g.10gb',
      gpus: 1
    });
  });

  it('takes what would queue when nothing can start now', () => {
    const busy = team({
      team: 'audio',
      offers: [
        offer({ name: 'mig-3g.40gb', kind: 'mig', cost: 0.5, ...judged('wait', 'none free') }),
        h100(1, 'wait', 'none free right now'),
        h100(2, 'wait', 'none free right now'),
        h100(3, 'never', 'this pool holds at most 2 of h100 on one node')
      ]
    });
    const only = { ...offers, teams: [busy] };
    expect(initialChoice(only, null)).toMatchObject({ team: 'audio', offer: 'h100', gpus: 1 });
    expect(initialChoice(only, { offer: 'h100', gpus: 3 })).toMatchObject({ gpus: 2 });
    expect(initialChoice(only, { offer: 'mig-3g.40gb', gpus: 2 })).toMatchObject({
      offer: 'mig-3g.40gb',
      gpus: 1
    });
    const refused = team({
      team: 'audio',
      offers: [h100(1, 'never', 'beyond the limit')]
    });
    expect(initialChoice({ ...offers, teams: [refused] }, null)).toMatchObject({
      offer: 'h100',
      gpus: 1
    });
  });

  it('keeps the number of MIG instances while a line of it is available', () => {
    const last = { team: 'edge', offer: 'mig-1g.10gb', gpus: 2 };
    expect(initialChoice(edgeOffers, last)).toMatchObject(last);
    // 3 would queue, 2 start now: the most that can, below it.
    expect(initialChoice(edgeOffers, { ...last, gpus: 3 }).gpus).toBe(2);
    expect(initialChoice(edgeOffers, { ...last, gpus: 5 }).gpus).toBe(2);
  });

  it('takes one per node on a share, and a share before CPU', () => {
    expect(initialChoice(edgeOffers, { offer: 'share-6gb', gpus: 4 })).toMatchObject({
      team: 'edge',
      offer: 'share-6gb',
      gpus: 1
    });
    const shareOrCpu = team({ team: 'edge', offers: [edge.offers[0], quarter] });
    expect(initialChoice({ ...offers, teams: [shareOrCpu] }, { gpus: 2 })).toMatchObject({
      offer: 'share-6gb',
      gpus: 1
    });
  });

  it('ignores a team the user left and bad stored values', () => {
    const c = initialChoice(offers, { team: 'gone', nodes: -3, timeLimit: 5, gpus: 1.5 });
    expect(c).toMatchObject({ team: 'vision', nodes: 1, timeLimit: 3600, gpus: 1 });
  });

  it('copes with no teams', () => {
    expect(initialChoice({ ...offers, teams: [] })).toMatchObject({ team: '', offer: '' });
  });
});

describe('parseChoice', () => {
  it('keeps only well-typed fields', () => {
    expect(parseChoice({ team: 'nlp', gpus: '2', nodes: 2, cells: 'upto', extra: 1 })).toEqual({
      team: 'nlp',
      nodes: 2,
      cells: 'upto'
    });
    expect(parseChoice({ cells: 'bogus', timeLimit: Infinity })).toEqual({});
    expect(parseChoice(null)).toBeNull();
    expect(parseChoice([1])).toBeNull();
    expect(parseChoice('x')).toBeNull();
  });
});

describe('submission', () => {
  const form = { ...choice(), name: 'train' };

  it('maps the cells choice to the API', () => {
    expect(submission('a/b.ipynb', form, cells)).toEqual({
      path: 'a/b.ipynb',
      cells: 'all',
      gpus: 2,
      nodes: 1,
      offer: 'h100',
      team: 'vision',
      time_limit: 3600,
      name: 'train'
    });
    expect(submission('x.ipynb', { ...form, cells: 'upto' }, cells).cells).toEqual({ upto: 2 });
    expect(submission('x.ipynb', { ...form, cells: 'selected' }, cells).cells).toEqual({
      selected: [1, 2]
    });
    expect(submission('x.ipynb', { ...form, team: '' }, cells).team).toBeNull();
  });
});
