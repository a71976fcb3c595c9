// The two dialogs: settings (system prompt, sampling, JSON-schema output), checked before
// they are kept, and the API key, asked for when the server answers 401 and shown with
// the server's own message when a key is refused.

import { saveSettings, setApiKey } from "./store.js";

const $ = (id) => document.getElementById(id);

function numberOr(value, fallback) {
  const n = Number(value);
  return value !== "" && Number.isFinite(n) ? n : fallback;
}

export function openSettings(settings) {
  $("set-system").value = settings.systemPrompt;
  $("set-temperature").value = settings.temperature;
  $("set-top-p").value = settings.topP;
  $("set-max-tokens").value = settings.maxTokens;
  $("set-schema").value = settings.jsonSchema;
  $("settings-error").textContent = "";
  $("settings").showModal();
}

// Reads the form into `settings`; returns an error message instead when a field is wrong.
function readSettings(settings) {
  const schema = $("set-schema").value.trim();
  if (schema) {
    try {
      const parsed = JSON.parse(schema);
      if (typeof parsed !== "object" || parsed === null) return "the JSON schema must be an object";
    } catch (error) {
      return `the JSON schema is not JSON: ${error.message}`;
    }
  }
  const maxTokens = Math.round(numberOr($("set-max-tokens").value, settings.maxTokens));
  if (maxTokens < 1) return "max tokens must be at least 1";
  settings.systemPrompt = $("set-system").value;
  settings.temperature = numberOr($("set-temperature").value, settings.temperature);
  settings.topP = numberOr($("set-top-p").value, settings.topP);
  settings.maxTokens = maxTokens;
  settings.jsonSchema = schema;
  return null;
}

export function wireSettings(settings, onForgetKey) {
  $("settings-form").addEventListener("submit", (event) => {
    const problem = readSettings(settings);
    if (problem) {
      event.preventDefault();
      $("settings-error").textContent = problem;
      return;
    }
    saveSettings(settings);
  });
  $("settings-cancel").addEventListener("click", () => $("settings").close());
  $("forget-key").addEventListener("click", () => {
    setApiKey("");
    $("settings").close();
    onForgetKey();
  });
}

// Resolves once a key has been entered; the caller tries it and calls again on a 401.
export function askApiKey(message) {
  const dialog = $("key-dialog");
  $("key-error").textContent = message || "";
  $("key-input").value = "";
  return new Promise((resolve) => {
    const form = $("key-form");
    const submit = (event) => {
      const key = $("key-input").value.trim();
      if (!key) {
        event.preventDefault();
        return;
      }
      form.removeEventListener("submit", submit);
      setApiKey(key);
      resolve(key);
    };
    form.addEventListener("submit", submit);
    if (!dialog.open) dialog.showModal();
  });
}
