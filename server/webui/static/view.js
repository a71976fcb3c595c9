// Turns the page's state into DOM: the sidebar's list of conversations and the messages of
// the open one. User text is shown as typed; an answer goes through the Markdown renderer,
// its reasoning folded above it, its measurements and any error below it.

import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const HINT = "Ask anything. Enter sends, Shift+Enter starts a new line.";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(className, text, onClick) {
  const b = el("button", className, text);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

export function renderSidebar(conversations, currentId, actions) {
  const nav = $("conversations");
  nav.replaceChildren();
  for (const conv of conversations) {
    const item = el("div", conv.id === currentId ? "conv active" : "conv");
    const open = button("conv-open", conv.title, () => actions.open(conv.id));
    open.title = conv.title;
    const remove = button("conv-delete", "\u00d7", () => actions.remove(conv.id));
    remove.setAttribute("aria-label", `Delete ${conv.title}`);
    item.append(open, remove);
    nav.append(item);
  }
}

export function renderMessages(conv, busy, actions) {
  const box = $("messages");
  box.replaceChildren();
  if (!conv.messages.length) box.append(el("p", "hint", HINT));
  const lastAssistant = conv.messages.map((m) => m.role).lastIndexOf("assistant");
  conv.messages.forEach((msg, index) => {
    const node =
      msg.role === "user"
        ? userNode(msg, index, busy, actions)
        : assistantNode(msg, index === lastAssistant && !busy, actions);
    box.append(node);
  });
  box.scrollTop = box.scrollHeight;
}

function userNode(msg, index, busy, actions) {
  const node = el("article", "msg user");
  node.append(el("div", "content", msg.content));
  const footer = el("footer", "meta");
  if (!busy) footer.append(button("edit", "Edit", () => startEdit(node, msg, index, actions)));
  node.append(footer);
  return node;
}

function startEdit(node, msg, index, actions) {
  const area = el("textarea", "edit-box");
  area.value = msg.content;
  area.rows = Math.min(10, msg.content.split("\n").length + 1);
  const bar = el("div", "buttons");
  bar.append(
    button("cancel", "Cancel", () => actions.rerender()),
    button("resend", "Send", () => area.value.trim() && actions.resend(index, area.value)),
  );
  node.replaceChildren(area, bar);
  area.focus();
}

export function assistantNode(msg, last, actions) {
  const node = el("article", "msg assistant");
  fillAssistant(node, msg, last ? actions : null);
  return node;
}

// Rebuilt whole on every update: an answer is a few kilobytes, and Markdown read from the
// start is the only reading that stays right as the text grows.
export function fillAssistant(node, msg, actions = null) {
  const parts = [];
  if (msg.reasoning) {
    const details = el("details", "reasoning");
    details.open = node.querySelector("details.reasoning")?.open ?? false;
    details.append(el("summary", null, "Reasoning"), el("div", "reasoning-text", msg.reasoning));
    parts.push(details);
  }
  const content = el("div", "content markdown");
  content.append(renderMarkdown(msg.content));
  parts.push(content);
  if (msg.error) {
    const error = el("div", "error", msg.error.message);
    error.dataset.status = String(msg.error.status ?? "");
    parts.push(error);
  }
  const footer = el("footer", "meta");
  footer.append(el("span", "stats", statsText(msg)));
  if (actions) {
    const again = msg.error && msg.error.status === 503 ? "Retry" : "Regenerate";
    footer.append(button("regenerate", again, () => actions.regenerate()));
  }
  parts.push(footer);
  node.replaceChildren(...parts);
}

function statsText(msg) {
  const s = msg.stats;
  if (!s) return "";
  const parts = [`${s.tokens} tokens`];
  if (s.tokensPerS !== null) parts.push(`${s.tokensPerS.toFixed(1)} tok/s`);
  if (s.ttftS !== null) parts.push(`first token ${s.ttftS.toFixed(2)} s`);
  if (s.stopped) parts.push("stopped");
  else if (s.finishReason === "length") parts.push("cut at max tokens");
  return parts.join(" \u00b7 ");
}
