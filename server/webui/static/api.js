// The server's OpenAI-compatible API as the page uses it: requests with the stored API
// key, errors carried as the server's own message and status, and a chat stream read as
// server-sent events through fetch (so that an AbortController can end it; the server
// frees the request's KV blocks when the connection closes).

import { getApiKey } from "./store.js";

export class ApiError extends Error {
  constructor(status, message, retryAfter = null) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

function headers(extra = {}) {
  const h = { ...extra };
  const key = getApiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // Not JSON (a proxy's page, say): the status line is all there is to show.
  }
  return new ApiError(response.status, message, response.headers.get("Retry-After"));
}

export async function listModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()).data;
}

function* events(buffer) {
  // Yields each complete event's data and leaves the unfinished tail in buffer.text.
  let end;
  while ((end = buffer.text.search(/\r?\n\r?\n/)) >= 0) {
    const block = buffer.text.slice(0, end);
    buffer.text = buffer.text.slice(end).replace(/^\r?\n\r?\n/, "");
    const data = block
      .split(/\r?\n/)
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).replace(/^ /, ""))
      .join("\n");
    if (data) yield data;
  }
}

// Calls onChunk with every parsed chunk of the stream; resolves when it ends.
export async function streamChat(body, signal, onChunk) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const buffer = { text: "" };
  for (;;) {
    const { value, done } = await reader.read();
    buffer.text += decoder.decode(value ?? new Uint8Array(), { stream: !done });
    for (const data of events(buffer)) {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.code ?? 500, chunk.error.message);
      onChunk(chunk);
    }
    if (done) return;
  }
}
