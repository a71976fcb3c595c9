// One answer: the request built from the open conversation and the settings, the stream
// read into the answer's node as it grows, and what the stream measured (tokens, tokens
// per second, time to first token). Stop aborts the fetch, which closes the connection;
// the server then ends the request and frees its KV blocks, as on any disconnect.

import { streamChat } from "./api.js";
import { fillAssistant } from "./view.js";

export function requestBody(messages, settings) {
  const history = messages
    .filter((m) => !m.error && (m.role === "user" || m.content))
    .map((m) => ({ role: m.role, content: m.content }));
  if (settings.systemPrompt.trim()) history.unshift({ role: "system", content: settings.systemPrompt });
  const body = {
    model: settings.model || undefined,
    messages: history,
    temperature: settings.temperature,
    top_p: settings.topP,
    max_tokens: settings.maxTokens,
  };
  if (settings.jsonSchema.trim()) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse(settings.jsonSchema), strict: true },
    };
  }
  return body;
}

// Streams an answer to conv's messages (which end with the user's turn) into `node`,
// repainted once per frame at most; resolves once the answer is complete, stopped or
// failed, with the message filled in either way.
export async function streamAnswer(conv, settings, node, controller) {
  const msg = { role: "assistant", content: "", reasoning: "", stats: null };
  const body = requestBody(conv.messages, settings);
  conv.messages.push(msg);
  const started = performance.now();
  let firstAt = null;
  let chunks = 0;
  let usage = null;
  let finishReason = null;
  let pending = false;
  const paint = () => {
    pending = false;
    fillAssistant(node, msg);
    const box = node.parentElement;
    if (box && box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  };
  fillAssistant(node, msg);
  let stopped = false;
  try {
    await streamChat(body, controller.signal, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.finish_reason) finishReason = choice.finish_reason;
      const delta = choice.delta || {};
      const reasoning = delta.reasoning_content ?? delta.reasoning;
      if (!reasoning && !delta.content) return;
      if (firstAt === null) firstAt = performance.now();
      chunks += 1;
      if (reasoning) msg.reasoning += reasoning;
      if (delta.content) msg.content += delta.content;
      if (!pending) {
        pending = true;
        requestAnimationFrame(paint);
      }
    });
  } catch (error) {
    if (error.name === "AbortError") stopped = true;
    else msg.error = { status: error.status ?? null, message: error.message, retryAfter: error.retryAfter ?? null };
  }
  const ended = performance.now();
  const tokens = usage ? usage.completion_tokens : chunks;
  msg.stats = {
    tokens,
    // Decode speed: the tokens after the first over the time they took, as llama.cpp counts.
    tokensPerS: firstAt !== null && tokens > 1 && ended > firstAt ? ((tokens - 1) * 1000) / (ended - firstAt) : null,
    ttftS: firstAt !== null ? (firstAt - started) / 1000 : null,
    finishReason,
    stopped,
  };
  if (msg.error && msg.error.status === 503 && msg.error.retryAfter) {
    msg.error.message += ` (the server is busy: retry in ${msg.error.retryAfter} s)`;
  }
  return msg;
}
