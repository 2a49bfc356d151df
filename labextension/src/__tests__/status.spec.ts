import { nullTranslator } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import * as api from '../api';
import { AllocationStatus } from '../status';

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

describe('AllocationStatus', () => {
  let item: AllocationStatus | null = null;

  afterEach(() => {
    item?.dispose();
    jest.resetAllMocks();
  });

  function create(): AllocationStatus {
    item = new AllocationStatus({ trans: nullTranslator.load('gpupool_lab') });
    Widget.attach(item, document.body);
    return item;
  }

  it("shows the allocation's label", async () => {
    mocked.getAllocation.mockResolvedValue({
      label: 'H100-80GB ×1 · vision',
      offer: 'h100',
      team: 'vision',
      simulated: false,
      allocation: 'GPU-1234'
    });
    const widget = create();
    await settle();
    expect(widget.node.classList.contains('gpupool-status')).toBe(true);
    expect(widget.node.textContent).toBe('H100-80GB ×1 · vision');
  });

  it('says when the inventory is simulated', async () => {
    mocked.getAllocation.mockResolvedValue({
      label: 'MIG 3g.40gb · nlp',
      offer: 'mig-3g.40gb',
      team: 'nlp',
      simulated: true,
      allocation: 'MIG-GPU-0/1/0'
    });
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
});
