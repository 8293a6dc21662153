// Talking to the server: the API key kept in this browser, errors in OpenAI's format, SSE streams.
// Every URL is relative, so the page works under a proxy's path prefix (--root-path).

const KEY_ITEM = "nanoserve.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

/** A refused request: the HTTP status and the server's own message. */
export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.name = "HttpError";
    this.status = status;
  }
}

/** An error event inside a stream that had already begun (e.g. the engine died mid-reply). */
export class StreamError extends Error {
  constructor(status, message) {
    super(message);
    this.name = "StreamError";
    this.status = status;
  }
}

/** fetch() with the API key; throws HttpError (with the server's message) unless the answer is 2xx. */
export async function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch {
    // not JSON (e.g. a proxy's error page): show what came
  }
  return text.trim().slice(0, 300) || response.statusText;
}

/** Calls onEvent with each parsed `data:` event of a server-sent-event response until [DONE]. */
export async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new StreamError(undefined, "The server closed the stream before it finished.");
    buffered += value;
    // a page that fell behind reads many events at once: walk them with a cursor, so the chunk is not
    // copied again after each one (quadratic in its size, which kept a busy page from its Stop button)
    let start = 0;
    let end;
    while ((end = buffered.indexOf("\n\n", start)) >= 0) {
      const block = buffered.slice(start, end);
      start = end + 2;
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new StreamError(event.error.code, event.error.message);
        onEvent(event);
      }
    }
    buffered = buffered.slice(start);
  }
}

/** What to tell the user about a failed request, by status. */
export function describe(error) {
  if (error instanceof TypeError) return `Cannot reach the server (${error.message}).`;
  const status = error.status;
  const prefix = {
    400: "The server refused the request",
    401: apiKey() ? "The server refused the API key" : "This server needs an API key",
    404: "Not found",
    413: "The request is too large",
    429: "The server is busy; try again in a moment",
    503: "The engine is not available",
  }[status] || (status >= 500 ? "The server failed" : "The request failed");
  return status ? `${prefix} (${status}): ${error.message}` : `${prefix}: ${error.message}`;
}
