// The page: two views (chat, dashboard) as tabs, one error line, and the API-key form shown when the
// server answers 401.

import { apiKey, describe, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["chat", "dashboard"];

const notify = {
  error(error) {
    $("error-text").textContent = describe(error);
    $("error").hidden = false;
  },
  clearError() {
    $("error-text").textContent = "";
    $("error").hidden = true;
  },
  unauthorized(error) {
    notify.error(error);
    $("key-form").hidden = false;
    $("api-key").focus();
  },
  model(name) {
    $("model-name").textContent = name;
  },
};

new Chat(notify);
const dashboard = new Dashboard(notify);

function show(view, focus = false) {
  for (const name of VIEWS) {
    const selected = name === view;
    const tab = $(`tab-${name}`);
    tab.setAttribute("aria-selected", String(selected));
    tab.tabIndex = selected ? 0 : -1;
    $(`view-${name}`).hidden = !selected;
    if (selected && focus) tab.focus();
  }
  if (view === "dashboard") dashboard.start();
  else dashboard.stop();
  if (location.hash.slice(1) !== view) history.replaceState(null, "", `#${view}`);
}

for (const name of VIEWS) {
  const tab = $(`tab-${name}`);
  tab.addEventListener("click", () => show(name));
  tab.addEventListener("keydown", (e) => {
    const i = VIEWS.indexOf(name);
    const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: VIEWS.length - 1 }[e.key];
    if (next === undefined) return;
    e.preventDefault();
    show(VIEWS[(next + VIEWS.length) % VIEWS.length], true);
  });
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey($("api-key").value.trim());
  $("api-key").value = "";
  $("key-form").hidden = true;
  $("forget-key").hidden = !apiKey();
  notify.clearError();
  if (dashboard.active) dashboard.start();
  else checkAccess();
  $("prompt").focus();
});

$("forget-key").addEventListener("click", () => {
  setApiKey("");
  $("forget-key").hidden = true;
  checkAccess();
});

$("error-dismiss").addEventListener("click", () => notify.clearError());

/** One look at the dashboard data: the model's name, and whether this server wants a key we lack. */
async function checkAccess() {
  try {
    await dashboard.fetch();
  } catch (error) {
    if (error.status === 401) notify.unauthorized(error);
    else notify.error(error);
  }
}

$("forget-key").hidden = !apiKey();
show(VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat");
if (!dashboard.active) checkAccess(); // (the dashboard's own polling does the same)
document.body.dataset.ready = "true";
