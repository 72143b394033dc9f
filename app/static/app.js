// Molt Studio pages: live uPlot charts fed by the run's websocket, the compare overlay, toasts, local times.
"use strict";
const Molt = (() => {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
                  "#4b5563", "#65a30d"];
  // The run page charts every recorded metric, one chart per name, in the section its name falls in (first rule
  // that matches; "other" for the rest), so a new metric appears without a code change. A few names join another
  // metric's chart instead: the breaker's threshold and trips join grad_norm, tokens/s joins samples/s on a labelled
  // second axis, and each MoE layer's expert shares make one chart.
  const SECTIONS = [
    ["suites", "Eval suites", /\//],  // eval.suites: NAME/eval_reward, ...
    ["moe", "MoE", /^(moe_|expert_share_|routing_)/],
    ["agent", "Agent", /^(agent_|segments_per_episode|sampling_overrides)/],
    ["memory", "Memory", /(_gb$|_mem_|^rss)/],
    ["throughput", "Throughput", /(_per_s$|idle_ratio|occupancy)/],
    ["staleness", "Staleness", /^(stale|version$)/],
    ["env", "Env", /^(eval_)?(tool_|template_|env_|turns|prompt_|groups_|response_length)/],
    ["reward", "Reward", /(reward|pass_rate|accuracy)/],
    ["loss", "Loss", /(loss|grad_|breaker_|clip|kl|ratio|entropy|^lr$|mismatch|trained_fraction)/],
    ["other", "Other", /./],
  ];
  const JOINS = {breaker_threshold: "grad_norm", breaker_tripped: "grad_norm", tokens_per_s: "samples_per_s"};
  // chat, agent and GPU counters (an eval suite's too) are recorded as 0 by runs that have none: no data unless one is non-zero
  const ONLY_NONZERO = /^([^/]+\/)?(eval_)?(tool_|template_prefix|agent_|gpu_)|^(segments_per_episode|sampling_overrides)$/;
  const UNITS = [[/_gb$/, "GB"], [/^samples_per_s$/, "samples/s"], [/^tokens_per_s$/, "tokens/s"],
                 [/staleness/, "versions"], [/response_length/, "tokens"], [/^lr$/, "learning rate"],
                 [/(_rate|_ratio|_fraction|_share|share_l\d+_e\d+)$|accuracy/, "fraction"]];
  const unit = (name) => UNITS.find(([re]) => re.test(name))?.[1];
  const axisTitle = (name) => (unit(name) ? `${name} (${unit(name)})` : name);
  const X_TITLES = {step: "step", time: "wall time", elapsed: "elapsed (min)"};

  // The chart a metric is drawn in: {id, section, title, names, ...}; `store` holds the names recorded so far.
  function chartSpec(name, store, page) {
    const layer = name.match(/^expert_share_l(\d+)_e\d+$/)?.[1];
    if (layer !== undefined) return {id: `experts-l${layer}`, prefix: `expert_share_l${layer}_`, yTitle: "token share",
                                     title: `Expert token share, layer ${layer}`};
    if (JOINS[name] && store[JOINS[name]]) return null;  // drawn in that chart
    const spec = {id: name, title: name, lines: [{name}], yTitle: axisTitle(name)};
    if (name === "grad_norm") {
      spec.lines.push({name: "breaker_threshold", label: "breaker threshold", dash: true});
      spec.trips = "breaker_tripped";
      spec.points = true;  // the breaker's chart: raw, with points (smoothing would flatten the spike that tripped it)
      spec.title = "grad_norm (breaker threshold dashed; a trip: red line with ▼)";
    } else if (name === "samples_per_s") {
      spec.lines.push({name: "tokens_per_s", scale: "y2"});
      spec.y2Title = axisTitle("tokens_per_s");
      spec.title = "samples_per_s, tokens_per_s (right axis)";
    } else if (name === "staleness_max" && page.max_staleness != null) {
      spec.bound = page.max_staleness;
      spec.title = `staleness_max (bound loop.max_staleness = ${page.max_staleness} dashed)`;
    }
    if (name === "breaker_tripped") spec.points = true;
    return spec;
  }

  const COMPARE_METRICS = ["reward_mean", "eval_reward", "policy_loss", "grad_norm", "entropy", "response_length",
                           "staleness_mean", "mismatch_kl", "is_filter_ratio", "samples_per_s"];

  // JSON carries NaN and the infinities as strings; Number() reads them back.
  const num = (v) => (typeof v === "number" ? v : Number(v));

  // One metric series, kept sorted by step; a step seen again (a replay after resume) replaces its value.
  class Series {
    constructor() { this.step = []; this.value = []; this.time = []; }
    merge(s) {
      for (let i = 0; i < s.step.length; i++) {
        const st = s.step[i], v = num(s.value[i]), t = s.time[i], n = this.step.length;
        if (n === 0 || st > this.step[n - 1]) { this.step.push(st); this.value.push(v); this.time.push(t); continue; }
        let lo = 0, hi = n;
        while (lo < hi) { const mid = (lo + hi) >> 1; if (this.step[mid] < st) lo = mid + 1; else hi = mid; }
        if (this.step[lo] === st) { this.value[lo] = v; this.time[lo] = t; }
        else { this.step.splice(lo, 0, st); this.value.splice(lo, 0, v); this.time.splice(lo, 0, t); }
      }
    }
    get last() { return this.step.length ? this.step[this.step.length - 1] : -1; }
  }

  // Exponential moving average, debiased (as TensorBoard/W&B): weight 0 = raw, 0.99 = very smooth.
  function ema(values, weight) {
    const out = new Array(values.length);
    let acc = 0, norm = 0;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v == null) { out[i] = null; continue; }
      acc = acc * weight + (1 - weight) * v; norm = norm * weight + (1 - weight);
      out[i] = acc / norm;
    }
    return out;
  }

  // The theme's colours (app.css): the header's toggle redraws the charts with them (the molt-theme event).
  const cssVar = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  function alpha(hex, a) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${a})`;
  }

  // ---- the view: x axis, smoothing, log scale, chart filter; kept in the URL so that every view has an address ----
  function bindView(onChange) {
    const form = document.getElementById("view");
    const params = new URLSearchParams(location.search);
    const view = {x: X_TITLES[params.get("x")] ? params.get("x") : "step",
                  smooth: Math.min(0.99, Math.max(0, Number(params.get("smooth") ?? 0.6) || 0)),
                  log: params.get("log") === "1", q: params.get("q") || ""};
    if (![...form.x.options].some((o) => o.value === view.x)) view.x = "step";
    document.addEventListener("molt-theme", onChange);
    form.x.value = view.x; form.smooth.value = view.smooth; form.smooth_out.value = view.smooth; form.log.checked = view.log;
    if (form.q) form.q.value = view.q;
    form.addEventListener("input", () => {
      view.x = form.x.value; view.smooth = Number(form.smooth.value); view.log = form.log.checked;
      view.q = form.q ? form.q.value.trim() : "";
      form.smooth_out.value = view.smooth;
      const p = new URLSearchParams(location.search);
      p.set("x", view.x); p.set("smooth", view.smooth); p.set("log", view.log ? "1" : "0");
      if (view.q) p.set("q", view.q); else p.delete("q");
      history.replaceState(null, "", `${location.pathname}?${p}`);
      onChange();
    });
    return view;
  }

  // A flat series gets a range around its value (uPlot's default for an all-zero series is 0-100)
  function fitRange(u, min, max) {
    if (min == null || max == null) return [0, 1];
    if (min === max) {
      const pad = Math.abs(min) * 0.1 || 1;
      return [min - pad, max + pad];
    }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  const fmt = (v) => (v == null ? "" : Number.isFinite(v) ? String(+v.toPrecision(4)) : String(v));

  // ---- a chart: a uPlot with one legend entry per line (its value raw, and smoothed when smoothing is on: the raw
  // line is drawn faint under the smoothed one); sparse lines (evals, trips) raw with point markers ---------------
  class Chart {
    constructor(container, id, title, opts = {}) {
      this.root = document.createElement("div");
      this.root.className = "chart"; this.root.id = `chart-${id}`; this.root.hidden = true;
      this.root.dataset.points = "0";
      this.root.innerHTML = `<div class="chart-head"><h3></h3><label><input type="checkbox" name="log"> log</label>
        <label>smoothing <input type="number" name="smooth" min="0" max="0.99" step="0.1"></label></div>
        <div class="plot"></div><p class="markers muted"></p>`;
      this.root.querySelector("h3").textContent = title;
      (opts.before ? container.insertBefore(this.root, opts.before) : container.appendChild(this.root));
      this.yTitle = opts.yTitle || ""; this.y2Title = opts.y2Title || ""; this.sync = opts.sync;
      this.local = {};  // this chart's own log scale / smoothing; unset: the page's
      const head = this.root.querySelector(".chart-head");
      head.addEventListener("input", (e) => {
        e.stopPropagation();
        if (e.target.name === "log") this.local.log = e.target.checked;
        else this.local.smooth = Math.min(0.99, Math.max(0, Number(e.target.value) || 0));
        this.shape = "?";
        if (this.args) this.render(...this.args);
      });
      this.plot = null; this.shape = "";
    }

    // lines: [{label, color, series: Series, dash, scale, points}], markers: [{x, color, label, trip}],
    // hlines: [{y, label}]; view: {x, smooth, log, t0 (elapsed is counted from it; else from each line's start)}
    render(lines, view, markers = [], hlines = []) {
      this.args = [lines, view, markers, hlines];
      markers = [...markers];
      lines = lines.filter((l) => l.series && l.series.step.length);
      this.root.hidden = lines.length === 0;
      if (!lines.length) return;
      this.root.dataset.points = String(lines[0].series.step.length);
      const log = this.local.log ?? view.log, weight = this.local.smooth ?? view.smooth;
      this.root.querySelector("input[name=log]").checked = log;
      this.root.querySelector("input[name=smooth]").value = weight;
      const tables = [], series = [{label: X_TITLES[view.x], value: view.x === "time"
        ? (u, v) => (v == null ? "" : new Date(v * 1000).toLocaleString()) : (u, v) => fmt(v)}];
      const notes = [];
      for (const l of lines) {
        const s = l.series, n = s.step.length;
        const t0 = view.t0 ?? s.time[0];
        const xs = view.x === "time" ? s.time : view.x === "elapsed" ? s.time.map((t) => (t - t0) / 60) : s.step;
        const raw = s.value.map((v, i) => {
          if (!Number.isFinite(v)) {  // NaN and ±inf are drawn as marked positions, never silently dropped
            markers.push({x: xs[i], color: Number.isNaN(v) ? "#f59e0b" : "#7c3aed", label: `${l.label}=${v}`});
            return null;
          }
          return log && v <= 0 ? null : v;
        });
        // sparse: fewer points than steps (an eval every k steps); such a line is never smoothed
        const sparse = l.points || (n > 1 && (s.step[n - 1] - s.step[0]) / (n - 1) > 1.5) || n === 1;
        const smooth = weight > 0 && !l.dash && !sparse;
        tables.push([xs, smooth ? ema(raw, weight) : raw, raw]);
        series.push({label: l.label, stroke: l.color, width: l.dash ? 1.5 : 2, dash: l.dash ? [6, 4] : undefined,
                     spanGaps: true, scale: l.scale || "y", smooth,
                     points: sparse ? {show: true, size: 7, fill: l.color} : {show: false},
                     value: (u, v, si, idx) => {
                       const r = idx == null ? null : this.raws[si - 1][idx];
                       if (r == null) return "";
                       return u.series[si].smooth ? `${fmt(r)} (smoothed ${fmt(v)})` : fmt(r);
                     }});
      }
      for (const m of markers) notes.push(m.label);
      this.root.querySelector(".markers").textContent =
        notes.length ? `marked: ${notes.slice(0, 5).join(", ")}${notes.length > 5 ? ` (+${notes.length - 5})` : ""}` : "";
      const joined = tables.length === 1 ? tables[0] : uPlot.join(tables);
      const data = [joined[0]];
      this.raws = []; this.colors = lines.map((l) => l.color);
      for (let i = 0; i < lines.length; i++) { data.push(joined[1 + 2 * i]); this.raws.push(joined[2 + 2 * i]); }
      const y2 = lines.some((l) => l.scale === "y2");
      const shape = JSON.stringify([series.map((s) => [s.label, s.smooth, s.points?.show]), view.x, log, y2]);
      this.markers = markers; this.hlines = hlines;
      if (this.plot && shape === this.shape) { this.plot.setData(data); return; }
      if (this.plot) this.plot.destroy();
      this.shape = shape;
      const distr = log ? 3 : 1;
      const width = Math.max(300, this.root.clientWidth - 16);
      const axis = {stroke: cssVar("--axis"), size: 60, values: tickLabels, grid: {stroke: cssVar("--grid")},
                    ticks: {stroke: cssVar("--grid")}};  // the palette's own colours (light and dark)
      this.plot = new uPlot({
        width, height: 220, series,
        scales: {x: {time: view.x === "time"}, y: {distr, ...(log ? {} : {range: fitRange})},
                 ...(y2 ? {y2: {distr, ...(log ? {} : {range: fitRange})}} : {})},
        axes: [{...axis, size: 50, values: view.x === "time" ? undefined : tickLabels, label: X_TITLES[view.x]},
               {...axis, label: this.yTitle},
               ...(y2 ? [{...axis, scale: "y2", side: 1, grid: {show: false}, label: this.y2Title}] : [])],
        legend: {live: true},
        cursor: this.sync ? {sync: {key: this.sync}} : {},
        hooks: {draw: [(u) => this.drawMarks(u)]},
      }, data, this.root.querySelector(".plot"));
      this.root.plot = this.plot;  // tests read its scales and cursor
    }

    drawMarks(u) {
      const ctx = u.ctx, px = devicePixelRatio, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
      ctx.save();
      u.series.forEach((s, si) => {  // the raw line, faint, under its smoothed one
        if (si === 0 || !s.show || !s.smooth) return;
        ctx.strokeStyle = alpha(this.colors[si - 1], Number(cssVar("--raw-alpha")) || 0.35); ctx.lineWidth = px; ctx.setLineDash([]);
        ctx.beginPath();
        let pen = false;
        this.raws[si - 1].forEach((v, i) => {
          if (v == null) return;
          const x = u.valToPos(u.data[0][i], "x", true), y = u.valToPos(v, s.scale, true);
          if (pen) ctx.lineTo(x, y); else { ctx.moveTo(x, y); pen = true; }
        });
        ctx.stroke();
      });
      for (const m of this.markers || []) {
        const x = u.valToPos(m.x, "x", true);
        if (!Number.isFinite(x)) continue;
        ctx.strokeStyle = m.color; ctx.fillStyle = m.color;
        // a trip: a solid line with a triangle on top; NaN/inf: dashed (the threshold is a dashed *horizontal* line)
        ctx.lineWidth = (m.trip ? 2 : 1.5) * px;
        ctx.setLineDash(m.trip ? [] : [4 * px, 3 * px]);
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
        if (m.trip) {
          ctx.beginPath(); ctx.moveTo(x - 6 * px, top); ctx.lineTo(x + 6 * px, top); ctx.lineTo(x, top + 9 * px);
          ctx.closePath(); ctx.fill();
        }
      }
      for (const h of this.hlines || []) {
        const y = u.valToPos(h.y, "y", true);
        if (!Number.isFinite(y) || y < top || y > bottom) continue;
        ctx.strokeStyle = getComputedStyle(this.root).color; ctx.lineWidth = 1.5 * px;
        ctx.setLineDash([8 * px, 4 * px]);
        ctx.beginPath(); ctx.moveTo(u.bbox.left, y); ctx.lineTo(u.bbox.left + u.bbox.width, y); ctx.stroke();
        if (h.label) { ctx.fillStyle = ctx.strokeStyle; ctx.font = `${11 * px}px sans-serif`; ctx.fillText(h.label, u.bbox.left + 4 * px, y - 4 * px); }
      }
      ctx.restore();
    }

    resize() {
      if (this.plot && !this.root.hidden) this.plot.setSize({width: Math.max(300, this.root.clientWidth - 16), height: 220});
    }
  }

  function duration(secs) {
    const h = Math.floor(secs / 3600), m = Math.floor(secs / 60) % 60, s = Math.floor(secs % 60);
    return h ? `${h}h ${m}m` : m ? `${m}m ${s}s` : `${s}s`;
  }

  // uPlot's default labels round tiny values (a KL of 2e-5) to "0": use exponents at the extremes
  function tickLabels(u, splits) {
    return splits.map((v) => {
      if (v == null) return "";
      const a = Math.abs(v);
      return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(1) : String(+v.toPrecision(4));
    });
  }

  function throttled(fn, ms) {
    let timer = null;
    return () => { if (!timer) timer = setTimeout(() => { timer = null; fn(); }, ms); };
  }

  // ---- toasts ----------------------------------------------------------------------------------------------------
  function toast(text, kind = "alert") {
    const el = document.createElement("div");
    el.className = `toast ${kind}`; el.setAttribute("role", "alert");
    el.textContent = text;
    const close = document.createElement("button");
    close.textContent = "×"; close.className = "close"; close.onclick = () => el.remove();
    el.appendChild(close);
    document.getElementById("toasts").appendChild(el);
    setTimeout(() => el.remove(), 20000);
  }

  function formatTimes(root) {
    for (const el of root.querySelectorAll(".time[data-time]")) {
      const t = Number(el.dataset.time);
      el.textContent = el.dataset.time && t ? new Date(t * 1000).toLocaleString() : "";
    }
  }

  // ---- the run page ----------------------------------------------------------------------------------------------
  function runPage(page) {
    const store = {};           // name -> Series
    let lastStep = -1, retry = 0, status = null, ws = null;
    const knownAlerts = new Set();
    // what tests (and curious users) can read: received alerts with their arrival time, messages, reconnects, charts
    const charts = {};          // chart id -> {spec, chart, section}
    const state = window.__molt = {alerts: [], messages: 0, connects: 0, pageLoadedAt: Date.now(), charts};
    const container = document.getElementById("charts");
    const sections = {};
    const order = ["reward", "suites", "loss", "staleness", "throughput", "memory", "env", "agent", "moe", "other"];
    for (const [id, title] of [...SECTIONS].sort((a, b) => order.indexOf(a[0]) - order.indexOf(b[0]))) {
      const el = sections[id] = document.createElement("section");
      el.className = "chart-section"; el.id = `section-${id}`; el.hidden = true;
      el.innerHTML = `<h2></h2><div class="charts"></div>`;
      el.querySelector("h2").textContent = title;
      container.appendChild(el);
    }
    const render = throttled(draw, 150);
    const view = bindView(() => { for (const {chart} of Object.values(charts)) chart.shape = "?"; draw(); });
    view.t0 = page.started_at ?? undefined;
    const conn = document.getElementById("conn");

    // a chart per recorded name (chartSpec), made when the name's first data arrives, kept in name order
    function ensureChart(name) {
      const spec = chartSpec(name, store, page);
      if (!spec || charts[spec.id]) return;
      const section = SECTIONS.find(([, , re]) => re.test(name))[0];
      const list = sections[section].querySelector(".charts");
      const before = [...list.children].find((el) => el.id > `chart-${spec.id}`);
      charts[spec.id] = {spec, section, chart: new Chart(list, spec.id, spec.title,
                                                         {before, yTitle: spec.yTitle, y2Title: spec.y2Title, sync: "run"})};
      for (const [joined, into] of Object.entries(JOINS)) if (into === name && charts[joined]) removeChart(joined);
    }

    function removeChart(id) {  // a name that joined another chart (its own chart came first)
      charts[id].chart.plot?.destroy(); charts[id].chart.root.remove(); delete charts[id];
    }

    const hasData = (name) => store[name] && store[name].step.length &&
      (!ONLY_NONZERO.test(name) || store[name].value.some((v) => v !== 0));

    function draw() {
      for (const name of Object.keys(store)) ensureChart(name);
      const query = view.q.toLowerCase();
      for (const {spec, chart, section} of Object.values(charts)) {
        sections[section].hidden = false;  // laid out, so that a new chart gets the width of its column
        let specLines = spec.lines || [];
        if (spec.prefix) {  // the legend names each line by what follows the prefix (the expert: e0, e1, ...)
          specLines = Object.keys(store).filter((n) => n.startsWith(spec.prefix))
            .map((name) => ({name, label: name.slice(spec.prefix.length)}));
        }
        const names = specLines.map((l) => l.name).concat(spec.trips && store[spec.trips] ? [spec.trips] : []);
        chart.root.dataset.metrics = names.filter((n) => store[n]).join(" ");
        if (query && !names.some((n) => n.toLowerCase().includes(query)) && !spec.title.toLowerCase().includes(query)) {
          chart.root.hidden = true;
          continue;
        }
        const lines = specLines.filter((l) => hasData(l.name)).map((l, i) => ({
          label: l.label || l.name, color: COLORS[i % COLORS.length], series: store[l.name], dash: l.dash,
          scale: l.scale, points: spec.points && !l.dash}));
        const markers = [];
        if (spec.trips && store[spec.trips]) {
          const s = store[spec.trips];
          s.value.forEach((v, i) => {
            if (v >= 1) markers.push({x: view.x === "time" ? s.time[i] : view.x === "elapsed" ? (s.time[i] - (view.t0 ?? s.time[0])) / 60 : s.step[i],
                                      color: "#dc2626", label: `trip@${s.step[i]}`, trip: true});
          });
        }
        const hlines = spec.bound != null ? [{y: spec.bound, label: `bound ${spec.bound}`}] : [];
        chart.render(lines, view, markers, hlines);
      }
      for (const [id, el] of Object.entries(sections)) {
        el.hidden = !Object.values(charts).some((c) => c.section === id && !c.chart.root.hidden);
      }
      showOverview();
    }

    // the overview strip's elapsed time and ETA, from the run's start and its steps
    function showOverview() {
      const elapsed = document.getElementById("ov-elapsed"), eta = document.getElementById("ov-eta");
      if (!elapsed || !page.started_at) return;
      const end = page.finished_at ?? Date.now() / 1000, secs = end - page.started_at;
      elapsed.textContent = duration(secs);
      const step = Number(document.getElementById("run-step").textContent), total = page.total_steps;
      eta.textContent = page.finished_at ? "done" : step > 0 && step < total ? duration(secs / step * (total - step)) : "—";
      const evals = store[page.best ?? "eval_reward"];  // the best eval so far (of eval.best) and its step
      if (evals && evals.step.length) {
        let best = -1;
        evals.value.forEach((v, i) => { if (Number.isFinite(v) && (best < 0 || v > evals.value[best])) best = i; });
        if (best >= 0) document.getElementById("ov-best").textContent = `${fmt(evals.value[best])} at step ${evals.step[best]}`;
      }
    }

    function setConn(state, text) {
      conn.dataset.state = state;
      conn.textContent = text || {live: "● live", reconnecting: "○ reconnecting…", connecting: "○ connecting…",
                                  offline: "offline"}[state];
    }

    function showRun(run) {
      const el = (id) => document.getElementById(id);
      el("run-status").textContent = run.status; el("run-status").className = `status ${run.status}`;
      el("run-step").textContent = run.step; el("run-progress").value = run.step;
      el("run-version").textContent = run.version; el("run-restarts").textContent = run.restarts;
      el("run-alerts").textContent = run.alerts_open; el("run-alerts").className = run.alerts_open ? "badge" : "";
      el("run-error").hidden = !run.last_error; el("run-error").textContent = run.last_error || "";
      page.started_at = run.started_at; page.finished_at = run.finished_at; view.t0 ??= run.started_at ?? undefined;
      if (el("ov-pid")) el("ov-pid").textContent = run.pid ?? "—";
      if (status !== null && status !== run.status) {
        htmx.trigger(document.body, "refresh-actions"); htmx.trigger(document.body, "refresh-records");
      }
      status = run.status;
    }

    function handle(msg) {
      state.messages++;
      if (msg.type === "status") showRun(msg.run);
      else if (msg.type === "metrics") {
        for (const [name, s] of Object.entries(msg.series)) {
          (store[name] ||= new Series()).merge(s);
          lastStep = Math.max(lastStep, store[name].last);
        }
        render();
      } else if (msg.type === "alerts") msg.alerts.forEach((a) => knownAlerts.add(a.id));
      else if (msg.type === "alert") {
        if (knownAlerts.has(msg.alert.id)) return;
        knownAlerts.add(msg.alert.id);
        state.alerts.push({...msg.alert, receivedAt: Date.now()});
        toast(`${msg.alert.kind} alert: ${msg.alert.message}`);
        htmx.trigger(document.body, "refresh-alerts");
      } else if (msg.type === "ack") htmx.trigger(document.body, "refresh-alerts");
      else if (msg.type === "event") htmx.trigger(document.body, "refresh-records");
    }

    function connect() {
      // after a reconnect, backfill what was missed (with a margin: an eval result may land on an older step)
      const after = lastStep < 0 ? -1 : Math.max(-1, lastStep - 50);
      const proto = location.protocol === "https:" ? "wss" : "ws";
      ws = new WebSocket(`${proto}://${location.host}/ws/runs/${page.run_id}?after_step=${after}`);
      ws.onopen = () => { retry = 0; state.connects++; setConn("live"); };
      ws.onmessage = (e) => handle(JSON.parse(e.data));
      ws.onclose = (e) => {
        if (e.code === 4404) { setConn("offline", "run not found"); return; }
        setConn("reconnecting");
        setTimeout(connect, Math.min(5000, 300 * 2 ** retry++));
      };
    }
    window.addEventListener("resize", throttled(() => Object.values(charts).forEach(({chart}) => chart.resize()), 200));
    setInterval(showOverview, 1000);
    setConn("connecting");
    connect();
    state.reconnectNow = () => ws && ws.close();  // tests drop the connection to prove the page recovers
  }

  // ---- the compare page: one chart per metric, one line per run --------------------------------------------------
  function comparePage(page) {
    const stores = {};   // run id -> name -> Series
    const container = document.getElementById("charts");
    const charts = COMPARE_METRICS.map((name) => ({name, chart: new Chart(container, name, name,
                                                                          {yTitle: axisTitle(name), sync: "compare"})}));
    const view = bindView(() => { charts.forEach(({chart}) => chart.shape = "?"); draw(); });

    function draw() {
      for (const {name, chart} of charts) {
        const lines = page.run_ids.map((id, i) => ({label: `#${id} ${page.names[id]}`, color: COLORS[i % COLORS.length],
                                                    series: stores[id] && stores[id][name]}));
        chart.render(lines, view);
      }
    }

    async function load() {
      await Promise.all(page.run_ids.map(async (id) => {
        const r = await fetch(`/api/v1/runs/${id}/metrics?max_points=2000&names=${COMPARE_METRICS.join(",")}`,
                              {credentials: "same-origin"});
        if (!r.ok) return;
        const body = await r.json();
        stores[id] = {};
        for (const [name, s] of Object.entries(body.series)) (stores[id][name] = new Series()).merge(s);
      }));
      draw();
    }
    load();
    setInterval(load, 10000);  // runs still training keep growing
  }

  // ---- every page: the banner while the daemon is down, from /ws/daemon; a toast when it is back ------------------
  // A daemon stopped on request stays stopped: the banner then offers to start it (through `molt serve`).
  async function startDaemon(button) {
    button.disabled = true;
    const csrf = JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRF-Token"];
    const r = await fetch("/api/v1/daemon/start", {method: "POST", headers: {"X-CSRF-Token": csrf}});
    if (!r.ok) {
      toast((await r.json()).detail);
      button.disabled = false;
    }
  }

  function daemonBanner() {
    const banner = document.getElementById("daemon-banner");
    if (!banner) return;  // the login page: no token yet
    let retry = 0, wasDown = false;
    function connect() {
      const proto = location.protocol === "https:" ? "wss" : "ws";
      const ws = new WebSocket(`${proto}://${location.host}/ws/daemon`);
      ws.onopen = () => { retry = 0; };
      ws.onmessage = (e) => {
        const msg = JSON.parse(e.data);
        banner.hidden = msg.alive; banner.textContent = msg.message;
        if (msg.stopped) {
          const button = document.createElement("button");
          button.id = "daemon-start"; button.textContent = "Start";
          button.onclick = () => startDaemon(button);
          banner.append(" ", button);
        }
        if (msg.alive && wasDown) toast(`The daemon is back (pid ${msg.pid}).`, "info");
        wasDown = !msg.alive;
      };
      ws.onclose = () => setTimeout(connect, Math.min(5000, 300 * 2 ** retry++));
    }
    connect();
  }

  document.addEventListener("DOMContentLoaded", daemonBanner);
  document.addEventListener("DOMContentLoaded", () => formatTimes(document));
  document.addEventListener("htmx:load", (e) => formatTimes(e.target));
  return {runPage, comparePage, toast, ema, Series};
})();
