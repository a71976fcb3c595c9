// The page's start and its wiring: the models from /v1/models (asking for the API key
// when the server wants one), the conversations from localStorage, and what each button
// and key does. The answer itself is chat.js's; drawing is view.js's.

import { ApiError, listModels } from "./api.js";
import { streamAnswer } from "./chat.js";
import { askApiKey, openSettings, wireSettings } from "./dialogs.js";
import * as store from "./store.js";
import { assistantNode, renderMessages, renderSidebar } from "./view.js";

const $ = (id) => document.getElementById(id);

const state = {
  conversations: store.loadConversations(),
  current: null,
  settings: store.loadSettings(),
  controller: null,
};

function persist() {
  store.saveConversations(state.conversations);
  store.saveCurrentId(state.current.id);
}

const actions = {
  open(id) {
    if (state.controller) return;
    state.current = state.conversations.find((c) => c.id === id) ?? state.current;
    persist();
    document.body.classList.remove("sidebar-open");
    render();
  },
  remove(id) {
    if (state.controller && id === state.current.id) return;
    state.conversations = state.conversations.filter((c) => c.id !== id);
    if (state.current.id === id) state.current = startConversation();
    persist();
    render();
  },
  regenerate() {
    const messages = state.current.messages;
    if (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
    generate();
  },
  resend(index, text) {
    state.current.messages = state.current.messages.slice(0, index);
    state.current.messages.push({ role: "user", content: text });
    generate();
  },
  rerender: () => render(),
};

function startConversation() {
  const conv = store.newConversation();
  state.conversations.unshift(conv);
  return conv;
}

function render() {
  renderSidebar(state.conversations, state.current.id, actions);
  renderMessages(state.current, state.controller !== null, actions);
  $("send").hidden = state.controller !== null;
  $("stop").hidden = state.controller === null;
}

async function generate() {
  const conv = state.current;
  if (conv.title === "New chat" && conv.messages.length) {
    conv.title = conv.messages[0].content.slice(0, 48);
  }
  conv.updated = Date.now();
  state.controller = new AbortController();
  persist();
  render();
  const node = assistantNode({ content: "" }, false, actions);
  $("messages").append(node);
  const msg = await streamAnswer(conv, state.settings, node, state.controller);
  state.controller = null;
  persist();
  render();
  if (msg.error && msg.error.status === 401) await ensureKey(msg.error.message);
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  $("prompt").value = "";
  state.current.messages.push({ role: "user", content: text });
  generate();
}

function fillModels(models) {
  const select = $("model");
  select.replaceChildren();
  for (const card of models) {
    const option = document.createElement("option");
    option.value = card.id;
    const note = card.task === "embed" ? " (embeddings only)" : card.parent ? ` (adapter of ${card.parent})` : "";
    option.textContent = card.id + note;
    option.disabled = card.task === "embed";
    select.append(option);
  }
  const usable = models.filter((m) => m.task !== "embed").map((m) => m.id);
  if (!usable.includes(state.settings.model)) state.settings.model = usable[0] ?? "";
  select.value = state.settings.model;
  const chosen = models.find((m) => m.id === select.value);
  const count = models.length > 1 ? `${models.length} models · ` : "";
  $("model-status").textContent = chosen ? `${count}context ${chosen.max_model_len} tokens` : "no model";
}

// Loads the models, asking for a key for as long as the server answers 401.
async function ensureKey(message = "") {
  for (;;) {
    try {
      fillModels(await listModels());
      return;
    } catch (error) {
      if (!(error instanceof ApiError) || error.status !== 401) {
        $("model-status").textContent = `models unavailable: ${error.message}`;
        return;
      }
      // The first ask, with no key tried yet, needs no error line.
      await askApiKey(store.getApiKey() || message ? error.message : "");
    }
  }
}

function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller) return;
    state.current = state.current.messages.length ? startConversation() : state.current;
    persist();
    render();
    $("prompt").focus();
  });
  $("model").addEventListener("change", () => {
    state.settings.model = $("model").value;
    store.saveSettings(state.settings);
  });
  $("open-settings").addEventListener("click", () => openSettings(state.settings));
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  // The key dialog stays until a key is given: without one the page can do nothing.
  $("key-dialog").addEventListener("cancel", (event) => event.preventDefault());
  wireSettings(state.settings, () => ensureKey());
}

function boot() {
  const currentId = store.loadCurrentId();
  state.current = state.conversations.find((c) => c.id === currentId) ?? state.conversations[0] ?? startConversation();
  wire();
  render();
  ensureKey();
}

boot();
