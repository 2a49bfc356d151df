import { nullTranslator } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import type { IOffersReply } from '../api';
import { RunDistributedBody } from '../dialog';

const offers: IOffersReply = {
  simulated: true,
  inventory: '2× H100-80GB, MIG',
  teams: [
    {
      team: 'vision',
      used: 1,
      limit: 4,
      guarantee: 3,
      borrow_limit: 1,
      left: 3,
      user_used: 0,
      user_cap: null,
      offers: [
        {
          name: 'cpu',
          kind: 'cpu',
          label: 'CPU only',
          description: 'No GPU',
          count: 1,
          cost: 0,
          free: 0,
          enabled: true,
          reason: ''
        },
        {
          name: 'mig-3g.40gb',
          kind: 'mig',
          label: 'MIG 3g.40gb',
          description: 'Half an H100',
          count: 1,
          cost: 0.5,
          free: 0,
          enabled: false,
          reason: 'none free right now'
        },
        ...[1, 2, 3].map(count => ({
          name: 'h100',
          kind: 'gpu' as const,
          label: `H100-80GB ×${count}`,
          description: 'Whole H100',
          count,
          cost: count,
          free: 2,
          enabled: count <= 2,
          reason: count <= 2 ? '' : 'only 2 free on one node'
        }))
      ]
    }
  ]
};

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

describe('RunDistributedBody', () => {
  let body: RunDistributedBody;

  beforeEach(() => {
    body = new RunDistributedBody({
      offers,
      choice: {
        team: 'vision',
        offer: 'h100',
        gpus: 2,
        nodes: 1,
        timeLimit: 7200,
        cells: 'upto'
      },
      name: 'train',
      cells: { count: 4, active: 1, selected: [1] },
      trans: nullTranslator.load('gpupool_lab')
    });
    Widget.attach(body, document.body);
  });

  afterEach(() => {
    body.dispose();
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

  it('disables offers that cannot start, with the reason', () => {
    const options = Array.from(field<HTMLSelectElement>(body, 'select[name="offer"]').options).map(
      o => [o.value, o.disabled, o.textContent]
    );
    expect(options).toEqual([
      ['cpu', false, 'CPU only'],
      ['mig-3g.40gb', true, 'MIG 3g.40gb — 0 free (none free right now)'],
      ['h100', false, 'H100-80GB — 2 free']
    ]);
  });

  it('shows why the form is invalid and marks it for the dialog', () => {
    const error = field<HTMLElement>(body, '.gpupool-form-error');
    expect(error.textContent).toBe('');
    expect(error.classList.contains('jp-mod-error')).toBe(false);

    type(field<HTMLInputElement>(body, 'input[name="gpus"]'), '3');
    expect(error.textContent).toBe('H100-80GB ×3: only 2 free on one node.');
    expect(error.classList.contains('jp-mod-error')).toBe(true);

    type(field<HTMLInputElement>(body, 'input[name="gpus"]'), '1');
    expect(error.textContent).toBe('');
    expect(error.classList.contains('jp-mod-error')).toBe(false);
  });

  it('relabels the count for CPU and converts minutes to seconds', () => {
    type(field<HTMLSelectElement>(body, 'select[name="offer"]'), 'cpu');
    expect(body.node.textContent).toContain('Processes per node');
    type(field<HTMLInputElement>(body, 'input[name="time_limit"]'), '90');
    expect(body.getValue()).toMatchObject({ offer: 'cpu', timeLimit: 5400 });
  });
});
