import type { IOffer, IOffersReply, ITeamOffers } from '../api';
import {
  INotebookCells,
  initialChoice,
  IRunChoice,
  parseChoice,
  submission,
  validateChoice
} from '../validate';

function offer(partial: Partial<IOffer> & { name: string }): IOffer {
  return {
    kind: 'gpu',
    label: partial.name,
    description: '',
    count: 1,
    cost: 1,
    free: 4,
    enabled: true,
    reason: '',
    ...partial
  };
}

function h100(count: number, enabled = true, reason = ''): IOffer {
  return offer({
    name: 'h100',
    kind: 'gpu',
    label: `H100-80GB ×${count}`,
    count,
    cost: count,
    free: 2,
    enabled,
    reason
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
      enabled: false,
      reason: 'none free right now'
    }),
    h100(1),
    h100(2),
    h100(3, false, 'only 2 free on one node'),
    h100(4, false, 'needs 4 GPU-eq; team vision has 3 left')
  ]
});

const nlp = team({
  team: 'nlp',
  limit: 1,
  left: 1,
  user_cap: 1,
  user_used: 0.5,
  offers: [
    offer({ name: 'cpu', kind: 'cpu', label: 'CPU only', cost: 0 }),
    offer({ name: 'mig-1g.10gb', kind: 'mig', label: 'MIG 1g.10gb', cost: 0.125, free: 7 })
  ]
});

const offers: IOffersReply = { simulated: true, inventory: '2× H100-80GB', teams: [vision, nlp] };

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

describe('validateChoice', () => {
  it('accepts what the offers say can start now', () => {
    expect(validateChoice(choice(), offers, cells)).toBeNull();
    expect(validateChoice(choice({ gpus: 1, nodes: 3 }), offers, cells)).toBeNull();
    expect(validateChoice(choice({ offer: 'cpu', gpus: 8, nodes: 2 }), offers, cells)).toBeNull();
    expect(
      validateChoice(choice({ team: 'nlp', offer: 'mig-1g.10gb', gpus: 1, nodes: 4 }), offers)
    ).toBeNull();
  });

  it('gives the reason of a line that is not enabled', () => {
    expect(validateChoice(choice({ gpus: 3 }), offers, cells)).toBe(
      'H100-80GB ×3: only 2 free on one node.'
    );
    expect(validateChoice(choice({ offer: 'mig-3g.40gb', gpus: 1 }), offers, cells)).toBe(
      'MIG 3g.40gb: none free right now.'
    );
  });

  it('refuses counts the offer does not take', () => {
    expect(validateChoice(choice({ gpus: 9 }), offers, cells)).toBe(
      'H100-80GB takes 1 to 4 GPUs per node, not 9.'
    );
    expect(
      validateChoice(choice({ team: 'nlp', offer: 'mig-1g.10gb', gpus: 2 }), offers, cells)
    ).toBe('MIG 1g.10gb is one MIG instance per node: use 1 GPU per node.');
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

  it("counts every node against the team's quota and the user's cap", () => {
    expect(validateChoice(choice({ gpus: 2, nodes: 2 }), offers)).toBe(
      'The job needs 4 GPU-eq (2 × 2); team vision has 3 left.'
    );
    // nlp: cap 1, holds 0.5 → 0.5 left for the user; 5 × 0.125 = 0.625.
    expect(
      validateChoice(choice({ team: 'nlp', offer: 'mig-1g.10gb', gpus: 1, nodes: 5 }), offers)
    ).toBe('The job needs 0.625 GPU-eq; you have 0.5 of your cap left in team nlp.');
  });

  it('knows teams and offers', () => {
    expect(validateChoice(choice({ team: 'audio' }), offers)).toBe(
      'You are not in team audio; your teams: vision, nlp.'
    );
    expect(validateChoice(choice({ team: '' }), offers)).toBe('Choose a team: vision, nlp.');
    expect(validateChoice(choice({ team: 'nlp', offer: 'h100' }), offers)).toBe(
      'Team nlp may not request h100; allowed: cpu, mig-1g.10gb.'
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
