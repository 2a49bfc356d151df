import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/**
 * Call the gpupool server extension of this single-user server.
 *
 * @param endPoint - path under `<baseUrl>/gpupool/`, optionally with a query string
 *   (`jobs/abc/logs?rank=0&offset=10`)
 * @param init - the fetch options (method, body, ...)
 * @param settings - the server connection settings (the page's by default)
 * @returns the parsed JSON body (`undefined` for an empty body)
 * @throws {ServerConnection.ResponseError} on a non-2xx answer; its `message` is the server's
 *   JSON `message`, word for word (or the status line when the body carries none)
 * @throws {ServerConnection.NetworkError} when the server cannot be reached
 */
export async function requestAPI<T>(
  endPoint = '',
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const cut = endPoint.indexOf('?');
  const path = cut < 0 ? endPoint : endPoint.slice(0, cut);
  const query = cut < 0 ? '' : endPoint.slice(cut);
  const url = URLExt.join(settings.baseUrl, 'gpupool', path) + query;

  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }

  const text = await response.text();
  let data: unknown = undefined;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      data = text;
    }
  }

  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, errorMessage(response, data));
  }
  return data as T;
}

/**
 * The server's own words for a failed request.
 */
function errorMessage(response: Response, data: unknown): string {
  if (data !== null && typeof data === 'object') {
    const message = (data as { message?: unknown }).message;
    if (typeof message === 'string' && message.length > 0) {
      return message;
    }
  }
  if (typeof data === 'string' && data.trim().length > 0 && data.length <= 500) {
    return data.trim();
  }
  const status = `${response.status} ${response.statusText}`.trim();
  return `Request failed: ${status}`;
}
