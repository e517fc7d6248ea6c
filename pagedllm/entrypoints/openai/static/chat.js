// The chat page of `pagedllm serve` (served at "/"): a conversation streamed from
// /v1/chat/completions, with the model list of /v1/models, sampling settings, a system prompt,
// a stop button (aborts the stream; the server then aborts the request), the model's reasoning
// apart from its answer (the `reasoning` deltas a server with --reasoning-parser sends), and
// the API key of a server started with --api-key (asked for on a 401, kept in localStorage,
// sent as "Authorization: Bearer <key>").
//
// URLs are relative to the page, so a server behind a path prefix (--root-path) works too.
// <body data-state> is "loading", "idle", "streaming" or "needs-key".
"use strict";

(function () {
  const KEY_STORAGE = "pagedllm.apiKey";
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), status: $("status"), messages: $("messages"), prompt: $("prompt"),
    send: $("send"), stop: $("stop"), composer: $("composer"), newChat: $("new-chat"),
    systemPrompt: $("system-prompt"), temperature: $("temperature"), topP: $("top-p"),
    maxTokens: $("max-tokens"), keyForm: $("api-key-form"), apiKey: $("api-key"),
  };
  let history = []; // [{role, content}] of the finished turns
  let controller = null; // the AbortController of the running stream

  function setState(state, status) {
    document.body.dataset.state = state;
    ui.status.textContent = status || "";
    const streaming = state === "streaming";
    ui.send.disabled = streaming || state !== "idle";
    ui.stop.disabled = !streaming;
  }

  function headers() {
    const key = localStorage.getItem(KEY_STORAGE);
    const result = { "Content-Type": "application/json" };
    if (key) result["Authorization"] = "Bearer " + key;
    return result;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || JSON.stringify(body);
    } catch (_) {
      return response.status + " " + response.statusText;
    }
  }

  async function loadModels() {
    setState("loading", "Loading models...");
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (err) {
      setState("loading", "Server unreachable: " + err.message);
      return;
    }
    if (response.status === 401) {
      ui.keyForm.hidden = false;
      ui.apiKey.focus();
      setState("needs-key", localStorage.getItem(KEY_STORAGE) ? "The API key was refused." : "API key needed.");
      return;
    }
    if (!response.ok) {
      setState("loading", await errorText(response));
      return;
    }
    ui.keyForm.hidden = true;
    const models = (await response.json()).data.map((model) => model.id);
    ui.model.replaceChildren(...models.map((id) => new Option(id, id)));
    setState("idle", models.length ? "" : "The server lists no model.");
  }

  // One message's elements: {root, reasoning (a <details>), reasoningText, content}.
  function addMessage(role, text) {
    const root = document.createElement("div");
    root.className = "message " + role;
    const label = root.appendChild(document.createElement("div"));
    label.className = "role";
    label.appendChild(document.createTextNode(role));
    const view = { root: root, content: document.createElement("div") };
    if (role === "assistant") {
      const copy = label.appendChild(document.createElement("button"));
      copy.type = "button";
      copy.textContent = "copy";
      copy.addEventListener("click", () => navigator.clipboard.writeText(root.dataset.raw || ""));
      view.reasoning = root.appendChild(document.createElement("details"));
      view.reasoning.className = "reasoning";
      view.reasoning.hidden = true;
      view.reasoning.open = true;
      view.reasoning.appendChild(document.createElement("summary")).textContent = "Reasoning";
      view.reasoningText = view.reasoning.appendChild(document.createElement("div"));
      view.reasoningText.className = "reasoning-text";
    }
    view.content.className = "content";
    root.appendChild(view.content);
    root.dataset.raw = text;
    if (role === "assistant") PagedMarkdown.render(text, view.content);
    else view.content.textContent = text;
    ui.messages.appendChild(root);
    ui.messages.scrollTop = ui.messages.scrollHeight;
    return view;
  }

  function requestBody(messages) {
    const body = { model: ui.model.value, messages: messages, stream: true };
    const number = (input, parse) => (input.value.trim() === "" ? undefined : parse(input.value));
    body.temperature = number(ui.temperature, parseFloat);
    body.top_p = number(ui.topP, parseFloat);
    body.max_tokens = number(ui.maxTokens, (v) => parseInt(v, 10));
    return body;
  }

  // Read the server-sent events of `response`, calling onEvent(json) for each data line.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  async function send(text) {
    const system = ui.systemPrompt.value.trim();
    const turn = { role: "user", content: text };
    const messages = (system ? [{ role: "system", content: system }] : []).concat(history, [turn]);
    addMessage("user", text);
    const view = addMessage("assistant", "");
    let content = "";
    let reasoning = "";
    let painted = false;
    const paint = () => {
      painted = false;
      view.root.dataset.raw = content;
      PagedMarkdown.render(content, view.content);
      if (reasoning) {
        view.reasoning.hidden = false;
        view.reasoningText.textContent = reasoning;
        view.root.dataset.reasoning = reasoning;
      }
      ui.messages.scrollTop = ui.messages.scrollHeight;
    };
    controller = new AbortController();
    setState("streaming", "Generating...");
    let outcome = "done";
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)), signal: controller.signal,
      });
      if (response.status === 401) localStorage.removeItem(KEY_STORAGE);
      if (!response.ok) throw new Error(await errorText(response));
      await readEvents(response, (event) => {
        if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
        for (const choice of event.choices || []) {
          const delta = choice.delta || {};
          content += delta.content || "";
          reasoning += delta.reasoning || delta.reasoning_content || "";
        }
        if (!painted) {
          painted = true;
          requestAnimationFrame(paint);
        }
      });
    } catch (err) {
      if (err.name === "AbortError") {
        outcome = "stopped";
      } else {
        outcome = "error";
        view.root.classList.add("error");
        view.root.appendChild(document.createElement("div")).textContent = "Error: " + err.message;
      }
    }
    controller = null;
    paint();
    view.root.dataset.outcome = outcome;
    if (outcome === "stopped") {
      const note = view.root.appendChild(document.createElement("div"));
      note.className = "stopped";
      note.textContent = "(stopped)";
    }
    if (outcome !== "error") history.push(turn, { role: "assistant", content: content });
    setState("idle", outcome === "stopped" ? "Stopped." : "");
  }

  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = ui.prompt.value;
    if (!text.trim() || document.body.dataset.state !== "idle") return;
    ui.prompt.value = "";
    send(text);
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      ui.composer.requestSubmit();
    }
  });
  ui.stop.addEventListener("click", () => controller && controller.abort());
  ui.newChat.addEventListener("click", () => {
    if (controller) controller.abort();
    history = [];
    ui.messages.replaceChildren();
  });
  ui.keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORAGE, ui.apiKey.value.trim());
    ui.apiKey.value = "";
    loadModels();
  });

  loadModels();
})();
