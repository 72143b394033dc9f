"use strict";
// The Samples view: recorded episodes (GET /api/v1/runs/{id}/samples) as chat turns, action tokens painted by a
// colouring. Model and env text only ever goes in as textContent, never parsed as HTML: a policy that writes
// <script> or an onerror attribute shows those characters, and nothing runs.
const MoltSamples = (() => {
  const FILTERS = ["step", "kind", "min_reward", "passed", "tool_errors", "q"];
  const PAGE = 50;
  // Per colouring: an action token's value, and its colour given the range of the values on the page. One meaning
  // per scale: purple = more (entropy, staleness; improbable for the probability), blue/orange = below/above zero.
  // Every colour reads at >= 4.5:1 with its theme's token text (LIGHT, DARK below).
  const COLORINGS = {
    logprob: {label: "behaviour probability", value: (ep, i) => ep.tokens.logprob[i],
              scale: () => ({lo: 0, hi: 1, color: (v) => sequential(1 - Math.exp(v)), labels: ["p=0", "p=1"]})},
    entropy: {label: "entropy (nats)", value: (ep, i) => ep.tokens.entropy[i], scale: (values) => upTo(values)},
    advantage: {label: "advantage", value: (ep) => ep.advantage, scale: (values) => symmetric(values)},
    staleness: {label: "staleness (trainer version − token version)",
                value: (ep, i) => ep.version - ep.tokens.version[i], scale: (values) => upTo(values)},
    mismatch: {label: "mismatch (behaviour − trainer log-prob)", scale: (values) => symmetric(values),
               value: (ep, i) => (ep.tokens.trainer_logprob[i] == null ? null
                                  : ep.tokens.logprob[i] - ep.tokens.trainer_logprob[i])},
  };

  // Light colours under dark text; in the dark theme dark ones under light text, so that a confident token is not
  // a bright white patch on the dark page (both read at >= 4.5:1).
  const LIGHT = {pale: [248, 250, 252], purple: [192, 132, 252], blue: [147, 197, 253], orange: [253, 186, 116],
                 text: "#111827"};
  const DARK = {pale: [31, 41, 55], purple: [107, 33, 168], blue: [30, 64, 175], orange: [154, 52, 18], text: "#e5e7eb"};
  let P = LIGHT;

  function mix(from, to, t) {
    const x = Math.min(1, Math.max(0, t));
    return `rgb(${from.map((c, k) => Math.round(c + (to[k] - c) * x)).join(", ")})`;
  }

  const sequential = (t) => mix(P.pale, P.purple, t);

  // 0 up to the page's largest value (1 when every value is 0, so that 0 is pale and the legend reads 0 to 1).
  function upTo(values) {
    const hi = Math.max(0, ...values) || 1;
    return {lo: 0, hi, color: (v) => sequential(v / hi), labels: ["0", fmt(hi)]};
  }

  // Blue below zero, orange above, pale at zero; symmetric around zero (±1 when every value is 0).
  function symmetric(values) {
    const m = Math.max(0, ...values.map(Math.abs)) || 1;
    return {lo: -m, hi: m, labels: [fmt(-m), fmt(m)],
            color: (v) => (v < 0 ? mix(P.pale, P.blue, -v / m) : mix(P.pale, P.orange, v / m))};
  }

  const fmt = (v) => (v == null ? "—" : Number.isInteger(v) ? String(v) : Number(v).toPrecision(4));

  function el(tag, props = {}, ...children) {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);  // strings become text nodes
    return node;
  }

  function start(page) {
    const form = document.getElementById("sample-filters");
    const list = document.getElementById("samples");
    const more = document.getElementById("samples-more");
    const count = document.getElementById("samples-count");
    const error = document.getElementById("samples-error");
    const promptBar = document.getElementById("prompt-filter");
    const tip = document.getElementById("tok-tip");
    const base = page.api || `/api/v1/runs/${page.run_id}`;  // an evaluation's page names its own API
    const params = new URLSearchParams(location.search);
    const tokenOf = new WeakMap();  // a token's span -> {ep, i}, for its tooltip
    let prompt = params.get("prompt");
    let episodes = [], painted = [], cursor = null, total = 0, recorded = true;

    for (const name of [...FILTERS, "color"]) {
      if (params.has(name)) form.elements[name].value = params.get(name);
    }

    function query() {
      const q = new URLSearchParams();
      for (const name of FILTERS) {
        const value = form.elements[name].value.trim();
        if (value !== "") q.set(name, value);
      }
      if (prompt != null) q.set("prompt", prompt);
      return q;
    }

    function remember() {  // every view has an address
      const q = query();
      if (form.elements.color.value !== "none") q.set("color", form.elements.color.value);
      history.replaceState(null, "", location.pathname + (q.toString() ? "?" + q : ""));
      document.getElementById("samples-jsonl").href = `${base}/samples.jsonl?${query()}`;
      promptBar.hidden = prompt == null;
      promptBar.querySelector("code").textContent = prompt ?? "";
    }

    async function load(reset) {
      if (reset) { episodes = []; cursor = null; }
      delete list.dataset.loaded;
      const q = query();
      q.set("limit", PAGE);
      q.set("order", prompt == null ? "newest" : "oldest");  // one prompt across steps reads left to right
      if (cursor != null) q.set("cursor", cursor);
      const response = await fetch(`${base}/samples?${q}`);
      const body = await response.json();
      if (!response.ok) {
        const detail = body.detail;
        error.textContent = Array.isArray(detail) ? detail.map((d) => `${d.loc.at(-1)}: ${d.msg}`).join("; ") : String(detail);
        error.hidden = false;
        return;
      }
      error.hidden = true;
      episodes = episodes.concat(body.samples);
      cursor = body.next_cursor;
      total = body.total;
      more.hidden = cursor == null;
      render();
      list.dataset.loaded = String(episodes.length);  // for tests: the page shows what the API returned
    }

    function render() {
      painted = [];
      hideTip();
      list.replaceChildren();
      list.classList.toggle("by-step", prompt != null);
      count.textContent = total ? `${episodes.length} of ${total} episodes${prompt == null ? ", newest step first" : ""}`
                                : "";
      if (!episodes.length) {
        list.append(el("p", {className: "empty"}, recorded ? "No samples match the filters."
                       : `No samples yet${page.status === "queued" ? ": the run is queued" : ""}. Each step records `
                         + "some of its episodes here once it has trained."));
      } else if (prompt != null) {  // one prompt across steps: a column per step
        const columns = new Map();
        for (const ep of episodes) {
          if (!columns.has(ep.step)) {
            const column = el("div", {className: "step-column"}, el("h2", {}, `step ${ep.step}`));
            column.dataset.step = ep.step;
            columns.set(ep.step, column);
            list.append(column);
          }
          columns.get(ep.step).append(episode(ep));
        }
      } else {
        list.append(...episodes.map(episode));
      }
      paint();
    }

    function episode(ep) {
      const article = el("article", {className: `episode ${ep.success ? "pass" : "fail"}`});
      Object.assign(article.dataset, {id: ep.id, step: ep.step, kind: ep.kind});
      const same = el("button", {type: "button", className: "small"}, "this prompt at every step");
      same.addEventListener("click", () => {
        prompt = ep.prompt;
        form.elements.step.value = "";
        remember();
        load(true);
      });
      const facts = [`#${ep.id}`, ep.kind === "train" ? `group ${ep.group_id}` : "held-out prompt",
                     `reward ${fmt(ep.reward)}`, `advantage ${fmt(ep.advantage)}`, ep.success ? "pass" : "fail",
                     `turns ${ep.turns}`, `tool calls ${ep.tool_calls}`, `tool errors ${ep.tool_errors}`,
                     `trainer version ${ep.version}`];
      let title = `${ep.kind} · step ${ep.step}`;
      const evaluation = ep.kind === "evaluation" && page.evaluations?.[ep.step];  // its step is the evaluation's id
      if (evaluation) {
        title = `evaluation #${ep.step} · checkpoint ${evaluation.checkpoint}` +
          (evaluation.step != null && String(evaluation.step) !== String(evaluation.checkpoint) ? ` (step ${evaluation.step})` : "");
        facts[facts.length - 1] = `policy version ${evaluation.version ?? "unknown"}`;
      }
      article.append(el("header", {}, el("b", {}, title),
                        ...facts.map((fact) => el("span", {}, fact)), same));
      if (ep.images.length) {
        const thumbs = el("div", {className: "thumbs"});
        for (const src of ep.images) {
          if (src.startsWith("data:image/png;base64,")) thumbs.append(el("img", {src, alt: "episode image"}));
        }
        article.append(thumbs);
      }
      // Chat turns: runs of action tokens are the assistant's; the first other run is the prompt, later ones the
      // env's answers (a tool's when the episode called tools).
      const t = ep.tokens, spans = [];
      let turn = null;
      for (let i = 0; i < t.id.length; i++) {
        if (turn == null || t.action[i] !== t.action[i - 1]) {
          const role = t.action[i] ? "assistant" : i === 0 ? "user" : ep.tool_calls ? "tool" : "user";
          turn = el("div", {className: "body"});
          article.append(el("div", {className: `turn ${role}`}, el("span", {className: "role"}, role), turn));
        }
        // one tab stop per episode (roving focus): the arrow keys move between its tokens, each shows its tooltip
        const span = el("span", {className: t.action[i] ? "tok act" : "tok", tabIndex: i === 0 ? 0 : -1}, t.text[i]);
        tokenOf.set(span, {ep, i});
        if (t.action[i]) painted.push({span, ep, i});
        spans.push(span);
        turn.append(span);
      }
      highlight(spans, t.text);
      return article;
    }

    // The search's hits: every token that overlaps an occurrence of the text (case-insensitive, as the search).
    function highlight(spans, texts) {
      const needle = form.elements.q.value.trim().toLowerCase();
      if (!needle) return;
      const starts = [];
      let joined = "";
      for (const text of texts) { starts.push(joined.length); joined += text; }
      joined = joined.toLowerCase();
      for (let at = joined.indexOf(needle); at >= 0; at = joined.indexOf(needle, at + 1)) {
        spans.forEach((span, k) => {
          if (starts[k] < at + needle.length && starts[k] + texts[k].length > at) span.classList.add("hit");
        });
      }
    }

    function tooltip(ep, i) {
      const t = ep.tokens;
      const lines = [`token id ${t.id[i]}  ${JSON.stringify(t.text[i])}`];
      if (t.action[i]) {
        lines.push(`log-prob ${fmt(t.logprob[i])}  trainer ${fmt(t.trainer_logprob[i])}`,
                   `version ${t.version[i]}  staleness ${ep.version - t.version[i]}`,
                   `entropy ${fmt(t.entropy[i])}  advantage ${fmt(ep.advantage)}`,
                   `mismatch ${fmt(COLORINGS.mismatch.value(ep, i))}`);
      } else {
        lines.push("prompt or env token (not trained on)");
      }
      return lines.join("\n");
    }

    function showTip(span) {
      const {ep, i} = tokenOf.get(span);
      tip.textContent = tooltip(ep, i);
      tip.hidden = false;
      const box = span.getBoundingClientRect();
      tip.style.left = `${Math.max(4, Math.min(box.left, innerWidth - tip.offsetWidth - 8)) + scrollX}px`;
      tip.style.top = `${box.bottom + scrollY + 4}px`;
      span.setAttribute("aria-describedby", "tok-tip");
    }

    function hideTip() {
      tip.hidden = true;
      list.querySelector("[aria-describedby=tok-tip]")?.removeAttribute("aria-describedby");
    }

    list.addEventListener("mouseover", (e) => { if (tokenOf.has(e.target)) showTip(e.target); });
    list.addEventListener("mouseout", (e) => { if (tokenOf.has(e.target) && document.activeElement !== e.target) hideTip(); });
    list.addEventListener("focusin", (e) => { if (tokenOf.has(e.target)) showTip(e.target); });
    list.addEventListener("focusout", hideTip);
    list.addEventListener("keydown", (e) => {
      if (!tokenOf.has(e.target)) return;
      if (e.key === "Escape") { hideTip(); return; }
      const tokens = [...e.target.closest("article").querySelectorAll(".tok")];
      const k = tokens.indexOf(e.target);
      const to = {ArrowRight: k + 1, ArrowDown: k + 1, ArrowLeft: k - 1, ArrowUp: k - 1, Home: 0,
                  End: tokens.length - 1}[e.key];
      if (to === undefined || !tokens[to]) return;
      e.preventDefault();
      e.target.tabIndex = -1;
      tokens[to].tabIndex = 0;
      tokens[to].focus();
    });

    function paint() {
      const name = form.elements.color.value;
      const coloring = COLORINGS[name];
      const legend = document.getElementById("legend");
      legend.hidden = !coloring;
      if (!coloring) {
        for (const {span} of painted) { span.style.background = span.style.color = ""; delete span.dataset.value; }
        return;
      }
      P = getComputedStyle(document.documentElement).colorScheme === "dark" ? DARK : LIGHT;
      const values = painted.map(({ep, i}) => coloring.value(ep, i));
      const known = values.filter((v) => v != null);
      const scale = coloring.scale(known);
      painted.forEach(({span}, k) => {
        const v = values[k];
        span.dataset.value = v == null ? "" : String(v);
        span.style.background = v == null ? "" : scale.color(v);
        span.style.color = v == null ? "" : P.text;
      });
      const distinct = new Set(known);
      legend.querySelector(".name").textContent = coloring.label;
      legend.querySelector(".lo").textContent = scale.labels[0];
      legend.querySelector(".hi").textContent = scale.labels[1];
      legend.querySelector(".note").textContent = !known.length ? "no token on this page has a value"
        : distinct.size === 1 ? `every token on this page: ${fmt(known[0])}` : "";
      const stops = [0, 0.25, 0.5, 0.75, 1].map((f) => scale.color(name === "logprob" ? Math.log(Math.max(f, 1e-9))
                                                                   : scale.lo + f * (scale.hi - scale.lo)));
      legend.querySelector(".bar").style.background = `linear-gradient(to right, ${stops.join(", ")})`;
      legend.dataset.coloring = name;
    }

    async function loadSteps() {
      const response = await fetch(`${base}/samples/steps`);
      if (!response.ok) return;
      const select = form.elements.step, wanted = params.get("step");
      const rows = await response.json(), kinds = {};
      rows.forEach((s) => (kinds[s.step] ||= new Set()).add(s.kind));
      // an evaluation's episodes are at step = its id: the option names the evaluation and the step it is from
      const label = (step) => {
        if (!kinds[step]?.has("evaluation")) return String(step);
        const e = page.evaluations?.[step];
        const name = `evaluation #${step}${e?.step != null ? ` (of step ${e.step})` : ""}`;
        return kinds[step].size > 1 ? `${step} · ${name}` : name;
      };
      const steps = [...new Set(rows.map((s) => s.step))].reverse();  // newest first
      recorded = steps.length > 0;
      if (wanted != null && !steps.includes(Number(wanted))) steps.unshift(wanted);  // an address keeps its step
      const first = select.options.length === 1, known = new Set([...select.options].map((o) => o.value));
      const added = steps.filter((step) => !known.has(String(step)));
      // newest first, after "all": a poll's new steps go above those already listed
      select.options[0].after(...added.map((step) => el("option", {value: String(step)}, label(step))));
      if (wanted != null && first) select.value = wanted;
      return added.length;
    }

    // While the run trains, new steps appear: listed, and shown at once when the view is the newest of all steps
    async function follow() {
      const added = await loadSteps();
      if (added && form.elements.step.value === "" && prompt == null && episodes.length <= PAGE) load(true);
    }
    if (["queued", "running", "restarting"].includes(page.status)) setInterval(follow, 5000);
    document.addEventListener("molt-theme", () => paint());

    form.addEventListener("change", (event) => {
      remember();
      if (event.target.name === "color") paint();
      else load(true);
    });
    promptBar.querySelector("button").addEventListener("click", () => { prompt = null; remember(); load(true); });
    more.addEventListener("click", () => load(false));
    loadSteps().then(() => { remember(); load(true); });  // after the steps: the URL's step is an option by then
  }

  return {start};
})();
