// The chat view: a conversation streamed token by token over /v1/chat/completions, kept in this
// browser (localStorage) across reloads. Stop aborts the fetch; the server then aborts the request.

import { apiFetch, describe, HttpError, readEvents } from "./api.js";

const STORE_ITEM = "nanoserve.chat";
const SETTINGS = ["system-prompt", "temperature", "top-p", "max-tokens", "seed", "ignore-eos"];

const $ = (id) => document.getElementById(id);

export class Chat {
  /** notify: { error(error), clearError(), unauthorized() } from the page. */
  constructor(notify) {
    this.notify = notify;
    this.messages = []; // {role, content, status?: "streaming"|"done"|"stopped"|"error", note?}
    this.controller = null;
    this.load();
    this.render();
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("clear").addEventListener("click", () => this.clear());
    for (const id of SETTINGS) $(id).addEventListener("change", () => this.save());
  }

  load() {
    let stored = null;
    try {
      stored = JSON.parse(localStorage.getItem(STORE_ITEM) || "null");
    } catch {
      stored = null; // unreadable: start afresh
    }
    if (!stored) return;
    this.messages = (stored.messages || []).map((m) =>
      // a reply that was streaming when the page went away ends there
      m.status === "streaming" ? { ...m, status: "stopped" } : m,
    );
    for (const id of SETTINGS) {
      if (!(id in (stored.settings || {}))) continue;
      const input = $(id);
      if (input.type === "checkbox") input.checked = stored.settings[id];
      else input.value = stored.settings[id];
    }
  }

  save() {
    const settings = {};
    for (const id of SETTINGS) {
      const input = $(id);
      settings[id] = input.type === "checkbox" ? input.checked : input.value;
    }
    localStorage.setItem(STORE_ITEM, JSON.stringify({ messages: this.messages, settings }));
  }

  clear() {
    this.stop();
    this.messages = [];
    this.save();
    this.render();
    this.notify.clearError();
    $("prompt").focus();
  }

  /** The request body: the conversation so far and the settings; empty fields keep server defaults. */
  body() {
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of this.messages) {
      if (m.content && m.status !== "error") messages.push({ role: m.role, content: m.content });
    }
    const body = { messages, stream: true };
    const numbers = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };
    for (const [field, id] of Object.entries(numbers)) {
      const value = $(id).value.trim();
      if (value !== "") body[field] = Number(value);
    }
    if ($("ignore-eos").checked) body.ignore_eos = true;
    return body;
  }

  async send() {
    const text = $("prompt").value.trim();
    if (!text || this.controller) return;
    this.notify.clearError();
    $("prompt").value = "";
    const question = { role: "user", content: text };
    const reply = { role: "assistant", content: "", status: "streaming" };
    this.messages.push(question);
    const body = this.body();
    this.messages.push(reply);
    this.save();
    const views = [this.append(question), this.append(reply)];
    const view = views[1];
    this.controller = new AbortController();
    this.setBusy(true);
    // deltas arrive far faster than frames: the text grows and scrolls once per frame, not per token
    let unshown = "";
    let frame = 0;
    const show = () => {
      cancelAnimationFrame(frame);
      frame = 0;
      if (!unshown) return;
      view.content.append(unshown);
      unshown = "";
      view.root.scrollIntoView({ block: "end" });
    };
    try {
      const response = await apiFetch("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: this.controller.signal,
      });
      await readEvents(response, (event) => {
        const choice = event.choices && event.choices[0];
        if (!choice) return;
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          reply.content += delta;
          unshown += delta;
          if (!frame) frame = requestAnimationFrame(show);
        }
        if (choice.finish_reason === "length") reply.note = "stopped at max tokens";
      });
      reply.status = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        reply.status = "stopped";
        reply.note = "stopped";
      } else if (error instanceof HttpError) {
        // refused before anything was generated: the message goes back into the box to send again
        this.messages.splice(-2, 2);
        for (const v of views) v.root.remove();
        $("prompt").value = text;
        if (error.status === 401) this.notify.unauthorized(error);
        else this.notify.error(error);
      } else {
        reply.status = "error";
        reply.note = describe(error);
        this.notify.error(error);
      }
    } finally {
      show();
      if (reply.status === "streaming") reply.status = "stopped";
      this.controller = null;
      this.setBusy(false);
      this.save();
      view.update(reply);
      $("empty-chat").hidden = this.messages.length > 0;
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    if (!busy && document.activeElement === $("stop")) $("prompt").focus();
  }

  /** Adds a message (already in this.messages) to the log; only new ones are added, so a screen
   * reader announces just them. */
  append(message) {
    const number = this.messages.filter((m) => m.role === "assistant").length;
    const view = new MessageView(message, number);
    $("messages").append(view.root);
    $("empty-chat").hidden = true;
    return view;
  }

  render() {
    $("messages").replaceChildren();
    let number = 0;
    for (const m of this.messages) {
      if (m.role === "assistant") number += 1;
      $("messages").append(new MessageView(m, number).root);
    }
    $("empty-chat").hidden = this.messages.length > 0;
  }
}

class MessageView {
  /** number: the reply's ordinal, to name its copy button. */
  constructor(message, number) {
    this.number = number;
    this.root = document.createElement("article");
    this.root.className = `message ${message.role}`;
    const role = document.createElement("p");
    role.className = "role";
    role.textContent = message.role === "user" ? "You" : "Assistant";
    this.content = document.createElement("div");
    this.content.className = "content";
    this.content.textContent = message.content;
    this.footer = document.createElement("div");
    this.footer.className = "message-footer";
    this.root.append(role, this.content);
    if (message.role === "assistant") this.root.append(this.footer);
    this.update(message);
  }

  update(message) {
    this.root.dataset.status = message.status || "done";
    this.root.setAttribute("aria-busy", String(message.status === "streaming"));
    this.footer.replaceChildren();
    if (message.note) {
      const note = document.createElement("span");
      note.className = "note";
      note.textContent = message.note;
      this.footer.append(note);
    }
    if (message.status !== "streaming" && message.content) {
      const copy = document.createElement("button");
      copy.type = "button";
      copy.className = "copy";
      copy.textContent = "Copy";
      copy.setAttribute("aria-label", `Copy reply ${this.number}`);
      copy.addEventListener("click", () => copyText(message.content, copy));
      this.footer.append(copy);
    }
  }
}

async function copyText(text, button) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
    } else {
      // plain http on another host is not a secure context: no clipboard API, the old way works
      const area = document.createElement("textarea");
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => (button.textContent = "Copy"), 2000);
}
