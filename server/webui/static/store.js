// What the page keeps in the browser's localStorage: the conversations (each a list of
// messages, as the API takes them, plus what the page measured), which one is open, the
// settings and the API key. Nothing is kept on the server.

const KEYS = {
  conversations: "llamaserve.conversations",
  current: "llamaserve.current",
  settings: "llamaserve.settings",
  apiKey: "llamaserve.apiKey",
};

export const DEFAULT_SETTINGS = {
  model: "",
  systemPrompt: "",
  temperature: 0.7,
  topP: 1,
  maxTokens: 512,
  jsonSchema: "",
};

function read(key, fallback) {
  try {
    const value = localStorage.getItem(key);
    return value === null ? fallback : JSON.parse(value);
  } catch {
    return fallback;
  }
}

function write(key, value) {
  localStorage.setItem(key, JSON.stringify(value));
}

export function getApiKey() {
  return read(KEYS.apiKey, "");
}

export function setApiKey(key) {
  write(KEYS.apiKey, key);
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(KEYS.settings, {}) };
}

export function saveSettings(settings) {
  write(KEYS.settings, settings);
}

export function loadConversations() {
  const list = read(KEYS.conversations, []);
  return Array.isArray(list) ? list : [];
}

export function saveConversations(list) {
  write(KEYS.conversations, list);
}

export function loadCurrentId() {
  return read(KEYS.current, null);
}

export function saveCurrentId(id) {
  write(KEYS.current, id);
}

export function newConversation() {
  const id = `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 7)}`;
  return { id, title: "New chat", messages: [], updated: Date.now() };
}
