import type { IStateDB } from '@jupyterlab/statedb';

import { ChoiceStore, notebookName } from '../run';
import { LAST_CHOICE_KEY } from '../tokens';
import type { IRunChoice } from '../validate';

const choice: IRunChoice = {
  team: 'vision',
  offer: 'h100',
  gpus: 2,
  nodes: 1,
  timeLimit: 3600,
  cells: 'upto'
};

describe('notebookName', () => {
  it('is the file name without .ipynb', () => {
    expect(notebookName('work/resnet/train.ipynb')).toBe('train');
    expect(notebookName('Untitled.IPYNB')).toBe('Untitled');
    expect(notebookName('.ipynb')).toBe('notebook');
  });
});

describe('ChoiceStore', () => {
  afterEach(() => window.localStorage.clear());

  it('remembers the last choice in localStorage without a state database', async () => {
    const store = new ChoiceStore(null);
    expect(await store.load()).toBeNull();
    await store.save({ ...choice, name: 'not kept' } as IRunChoice);
    expect(JSON.parse(window.localStorage.getItem(LAST_CHOICE_KEY) ?? '')).toEqual(choice);
    expect(await new ChoiceStore(null).load()).toEqual(choice);
  });

  it('uses the state database when there is one', async () => {
    const saved = new Map<string, unknown>();
    const state = {
      fetch: async (key: string) => saved.get(key),
      save: async (key: string, value: unknown) => {
        saved.set(key, value);
      }
    } as unknown as IStateDB;
    const store = new ChoiceStore(state);
    await store.save(choice);
    expect(saved.get(LAST_CHOICE_KEY)).toEqual(choice);
    expect(await store.load()).toEqual(choice);
    expect(window.localStorage.getItem(LAST_CHOICE_KEY)).toBeNull();
  });

  it('ignores what it cannot read', async () => {
    window.localStorage.setItem(LAST_CHOICE_KEY, '{not json');
    expect(await new ChoiceStore(null).load()).toBeNull();
  });
});
