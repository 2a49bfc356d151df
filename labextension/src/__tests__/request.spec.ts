import { ServerConnection } from '@jupyterlab/services';

import { cancelJob, getLogs, listJobs, resubmitJob, submitJob } from '../api';
import { requestAPI } from '../request';

const BASE = 'http://localhost:8888/user/alice/';

function settings(): ServerConnection.ISettings {
  return ServerConnection.makeSettings({ baseUrl: BASE });
}

/**
 * A reply as the single-user server sends it.
 */
function reply(status: number, body: unknown, statusText = ''): Response {
  const text = typeof body === 'string' ? body : JSON.stringify(body);
  return new Response(status === 204 ? null : text, {
    status,
    statusText,
    headers: { 'Content-Type': 'application/json' }
  });
}

/**
 * What a promise was rejected with.
 */
async function failure(promise: Promise<unknown>): Promise<any> {
  try {
    await promise;
  } catch (error) {
    return error;
  }
  throw new Error('expected a rejection');
}

describe('requestAPI', () => {
  let makeRequest: jest.SpyInstance;

  beforeEach(() => {
    makeRequest = jest.spyOn(ServerConnection, 'makeRequest');
  });

  afterEach(() => {
    makeRequest.mockRestore();
  });

  it('GETs <baseUrl>/gpupool/<endPoint> and returns the JSON', async () => {
    makeRequest.mockResolvedValue(reply(200, { jobs: [] }));
    const data = await requestAPI<{ jobs: unknown[] }>('jobs', {}, settings());
    expect(data).toEqual({ jobs: [] });
    expect(makeRequest).toHaveBeenCalledTimes(1);
    const [url, init] = makeRequest.mock.calls[0];
    expect(url).toBe(`${BASE}gpupool/jobs`);
    expect(init.method ?? 'GET').toBe('GET');
  });

  it('uses the page settings by default', async () => {
    makeRequest.mockResolvedValue(reply(200, { simulated: true, inventory: '', teams: [] }));
    await requestAPI('offers');
    const [url, , used] = makeRequest.mock.calls[0];
    expect(url).toMatch(/\/gpupool\/offers$/);
    expect(used.baseUrl).toBeTruthy();
  });

  it('keeps the query string out of the path join', async () => {
    makeRequest.mockResolvedValue(reply(200, { text: 'hi\n', size: 13, state: 'running' }));
    await requestAPI('jobs/abc/logs?rank=1&offset=10', {}, settings());
    expect(makeRequest.mock.calls[0][0]).toBe(`${BASE}gpupool/jobs/abc/logs?rank=1&offset=10`);
  });

  it('passes the method and the body through', async () => {
    makeRequest.mockResolvedValue(reply(201, { id: 'j1' }));
    const body = JSON.stringify({ name: 'train' });
    const data = await requestAPI('submit', { method: 'POST', body }, settings());
    expect(data).toEqual({ id: 'j1' });
    const [url, init] = makeRequest.mock.calls[0];
    expect(url).toBe(`${BASE}gpupool/submit`);
    expect(init.method).toBe('POST');
    expect(init.body).toBe(body);
  });

  it("throws the server's JSON message word for word", async () => {
    const message = 'No 3g.40gb free (team vision uses 3.5 of 4 GPU-eq). Free now: 2× 1g.10gb.';
    makeRequest.mockResolvedValue(reply(409, { status: 409, message }, 'Conflict'));
    const error = await failure(requestAPI('submit', { method: 'POST', body: '{}' }, settings()));
    expect(error).toBeInstanceOf(Error);
    expect(error).toBeInstanceOf(ServerConnection.ResponseError);
    expect(error.message).toBe(message);
    expect(error.response.status).toBe(409);
  });

  it('falls back to the status line when the error body has no message', async () => {
    makeRequest.mockResolvedValue(reply(502, '', 'Bad Gateway'));
    await expect(requestAPI('jobs', {}, settings())).rejects.toThrow(
      'Request failed: 502 Bad Gateway'
    );
  });

  it('reports a server that cannot be reached as a NetworkError', async () => {
    makeRequest.mockRejectedValue(new TypeError('Failed to fetch'));
    const error = await failure(requestAPI('jobs', {}, settings()));
    expect(error).toBeInstanceOf(ServerConnection.NetworkError);
    expect(error.message).toBe('Failed to fetch');
  });

  it('returns undefined for an empty body', async () => {
    makeRequest.mockResolvedValue(reply(204, ''));
    await expect(requestAPI('jobs/x', { method: 'DELETE' }, settings())).resolves.toBeUndefined();
  });
});

describe('the typed calls', () => {
  let makeRequest: jest.SpyInstance;

  beforeEach(() => {
    makeRequest = jest.spyOn(ServerConnection, 'makeRequest');
  });

  afterEach(() => {
    makeRequest.mockRestore();
  });

  it('submitJob POSTs the submission to submit', async () => {
    makeRequest.mockResolvedValue(reply(201, { id: 'j2', state: 'queued' }));
    const request = {
      path: 'work/train.ipynb',
      cells: { upto: 3 },
      gpus: 2,
      nodes: 1,
      offer: 'h100',
      team: 'vision',
      time_limit: 3600,
      name: 'train'
    };
    await submitJob(request);
    const [url, init] = makeRequest.mock.calls[0];
    expect(url).toMatch(/\/gpupool\/submit$/);
    expect(init.method).toBe('POST');
    expect(JSON.parse(init.body)).toEqual(request);
  });

  it('listJobs reads one page and its cursor', async () => {
    makeRequest.mockResolvedValue(reply(200, { jobs: [{ id: 'a' }, { id: 'b' }], next: 'c1' }));
    await expect(listJobs('c0', 2)).resolves.toEqual({
      jobs: [{ id: 'a' }, { id: 'b' }],
      next: 'c1'
    });
    expect(makeRequest.mock.calls[0][0]).toMatch(/jobs\?limit=2&cursor=c0$/);
  });

  it('cancelJob DELETEs, resubmitJob POSTs, ids are escaped', async () => {
    makeRequest.mockImplementation(async () => reply(200, { id: 'a b' }));
    await cancelJob('a b');
    expect(makeRequest.mock.calls[0][0]).toMatch(/\/gpupool\/jobs\/a%20b$/);
    expect(makeRequest.mock.calls[0][1].method).toBe('DELETE');
    await resubmitJob('a b');
    expect(makeRequest.mock.calls[1][0]).toMatch(/\/gpupool\/jobs\/a%20b\/resubmit$/);
    expect(makeRequest.mock.calls[1][1].method).toBe('POST');
  });

  it('getLogs asks for a rank from an offset', async () => {
    makeRequest.mockResolvedValue(reply(200, { text: '', size: 0, state: 'queued' }));
    await getLogs('j1', 2, 1024);
    expect(makeRequest.mock.calls[0][0]).toMatch(/\/gpupool\/jobs\/j1\/logs\?rank=2&offset=1024$/);
  });
});
