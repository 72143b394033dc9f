// Molt Studio pages: live uPlot charts fed by the run's websocket, the compare overlay, toasts, local times.
"use strict";
const Molt = (() => {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
                  "#4b5563", "#65a30d"];
  // The run page's charts: each names the metrics it draws (README "Metrics"); a chart without data stays hidden.
  const RUN_CHARTS = [
    {id: "reward", title: "Reward", lines: [{name: "reward_mean"}, {name: "eval_reward"}]},
    {id: "loss", title: "Policy loss", lines: [{name: "policy_loss"}]},
    {id: "grad_norm", title: "Gradient norm (breaker threshold dashed, trips in red)",
     lines: [{name: "grad_norm"}, {name: "breaker_threshold", dash: true}], trips: "breaker_tripped"},
    {id: "staleness", title: "Staleness (versions; bound dashed)",
     lines: [{name: "staleness_mean"}, {name: "staleness_max"}], bound: "max_staleness"},
    {id: "mismatch", title: "Logprob mismatch and IS filter ratio",
     lines: [{name: "mismatch_kl"}, {name: "mismatch_abs"}, {name: "is_filter_ratio"}]},
    {id: "throughput", title: "Throughput", lines: [{name: "samples_per_s"}, {name: "tokens_per_s", scale: "y2"}]},
    {id: "entropy", title: "Entropy", lines: [{name: "entropy"}]},
    {id: "length", title: "Response length", lines: [{name: "response_length"}]},
    {id: "tools", title: "Chat: tool calls per episode; tool errors and template prefix breaks per step",
     lines: [{name: "tool_call_rate"}, {name: "tool_error_rate"}, {name: "tool_errors", scale: "y2"},
             {name: "template_prefix_breaks", scale: "y2"}]},
    {id: "agents", title: "Agents: requests, segments and sampling overrides per episode; agent errors per step",
     lines: [{name: "agent_requests_per_episode"}, {name: "segments_per_episode"}, {name: "sampling_overrides"},
             {name: "agent_errors", scale: "y2"}]},
    {id: "accuracy", title: "Accuracy: strict (#### N) and flexible (last number), sampled and eval",
     lines: [{name: "accuracy_strict"}, {name: "accuracy_flexible"}, {name: "eval_accuracy_strict"},
             {name: "eval_accuracy_flexible"}]},
    {id: "router", title: "MoE router: balance entropy, aux loss, routing mismatch",
     lines: [{name: "moe_balance_entropy"}, {name: "moe_aux_loss", scale: "y2"}, {name: "routing_mismatch"}]},
    {id: "memory", title: "Memory (GB): GPU allocated, GPU peak since the last step, process RSS",
     lines: [{name: "gpu_mem_allocated_gb"}, {name: "gpu_mem_peak_gb"}, {name: "rss_gb"}]},
  ];
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

  // ---- the view: x axis, smoothing, log scale; kept in the URL so that every view has an address ----------------
  function bindView(onChange) {
    const form = document.getElementById("view");
    const params = new URLSearchParams(location.search);
    const view = {x: params.get("x") === "time" ? "time" : "step",
                  smooth: Math.min(0.99, Math.max(0, Number(params.get("smooth") ?? 0.6) || 0)),
                  log: params.get("log") === "1"};
    document.addEventListener("molt-theme", onChange);
    form.x.value = view.x; form.smooth.value = view.smooth; form.smooth_out.value = view.smooth; form.log.checked = view.log;
    form.addEventListener("input", () => {
      view.x = form.x.value; view.smooth = Number(form.smooth.value); view.log = form.log.checked;
      form.smooth_out.value = view.smooth;
      const p = new URLSearchParams(location.search);
      p.set("x", view.x); p.set("smooth", view.smooth); p.set("log", view.log ? "1" : "0");
      history.replaceState(null, "", `${location.pathname}?${p}`);
      onChange();
    });
    return view;
  }

  // ---- a chart: a uPlot with, per line, the raw series faint and its EMA on top ---------------------------------
  class Chart {
    constructor(container, id, title) {
      this.root = document.createElement("div");
      this.root.className = "chart"; this.root.id = `chart-${id}`; this.root.hidden = true;
      this.root.dataset.points = "0";
      this.root.innerHTML = `<h3></h3><div class="plot"></div><p class="markers muted"></p>`;
      this.root.querySelector("h3").textContent = title;
      container.appendChild(this.root);
      this.plot = null; this.shape = "";
    }

    // lines: [{label, color, series: Series, dash, scale}], markers: [{x, color, label}], hlines: [{y, label}]
    render(lines, view, markers = [], hlines = []) {
      lines = lines.filter((l) => l.series && l.series.step.length);
      this.root.hidden = lines.length === 0;
      if (!lines.length) return;
      this.root.dataset.points = String(lines[0].series.step.length);
      const tables = [], series = [{}], notes = [];
      const smooth = view.smooth > 0;
      for (const l of lines) {
        const xs = view.x === "time" ? l.series.time : l.series.step;
        const raw = l.series.value.map((v, i) => {
          if (!Number.isFinite(v)) {  // NaN and ±inf are drawn as marked positions, never silently dropped
            markers.push({x: xs[i], color: Number.isNaN(v) ? "#f59e0b" : "#7c3aed", label: `${l.label}=${v}`});
            return null;
          }
          return view.log && v <= 0 ? null : v;
        });
        const cols = [xs, raw];
        const scale = l.scale || "y";
        if (smooth && !l.dash) {
          cols.push(ema(raw, view.smooth));
          series.push({label: `${l.label} (raw)`, stroke: alpha(l.color, Number(cssVar("--raw-alpha"))), width: 1,
                       spanGaps: true, scale},
                      {label: l.label, stroke: l.color, width: 2, spanGaps: true, scale});
        } else {
          series.push({label: l.label, stroke: l.color, width: l.dash ? 1.5 : 2, dash: l.dash ? [6, 4] : undefined,
                       spanGaps: true, scale});
        }
        tables.push(cols);
      }
      for (const m of markers) notes.push(m.label);
      this.root.querySelector(".markers").textContent =
        notes.length ? `marked: ${notes.slice(0, 5).join(", ")}${notes.length > 5 ? ` (+${notes.length - 5})` : ""}` : "";
      const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
      const y2 = lines.some((l) => l.scale === "y2");
      const shape = JSON.stringify([series.map((s) => s.label), view.x, view.log, y2]);
      this.markers = markers; this.hlines = hlines;
      if (this.plot && shape === this.shape) { this.plot.setData(data); return; }
      if (this.plot) this.plot.destroy();
      this.shape = shape;
      const distr = view.log ? 3 : 1;
      const width = Math.max(300, this.root.clientWidth - 16);
      const self = this, axis = cssVar("--axis"), grid = cssVar("--grid");
      this.plot = new uPlot({
        width, height: 220, series,
        scales: {x: {time: view.x === "time"}, y: {distr}, ...(y2 ? {y2: {distr}} : {})},
        axes: [{stroke: axis, grid: {stroke: grid}}, {size: 60, values: tickLabels, stroke: axis, grid: {stroke: grid}},
               ...(y2 ? [{scale: "y2", side: 1, grid: {show: false}, size: 60, values: tickLabels, stroke: axis}] : [])],
        legend: {live: true},
        hooks: {draw: [(u) => self.drawMarks(u)]},
      }, data, this.root.querySelector(".plot"));
    }

    drawMarks(u) {
      const ctx = u.ctx;
      ctx.save();
      ctx.lineWidth = 1.5 * devicePixelRatio;
      for (const m of this.markers || []) {
        const x = u.valToPos(m.x, "x", true);
        if (!Number.isFinite(x)) continue;
        ctx.strokeStyle = m.color; ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
        ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
      }
      for (const h of this.hlines || []) {
        const y = u.valToPos(h.y, "y", true);
        if (!Number.isFinite(y) || y < u.bbox.top || y > u.bbox.top + u.bbox.height) continue;
        ctx.strokeStyle = cssVar("--fg"); ctx.setLineDash([8 * devicePixelRatio, 4 * devicePixelRatio]);
        ctx.beginPath(); ctx.moveTo(u.bbox.left, y); ctx.lineTo(u.bbox.left + u.bbox.width, y); ctx.stroke();
      }
      ctx.restore();
    }

    resize() {
      if (this.plot && !this.root.hidden) this.plot.setSize({width: Math.max(300, this.root.clientWidth - 16), height: 220});
    }
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
    // what tests (and curious users) can read: received alerts with their arrival time, messages, reconnects
    const state = window.__molt = {alerts: [], messages: 0, connects: 0, pageLoadedAt: Date.now()};
    const container = document.getElementById("charts");
    const charts = RUN_CHARTS.map((spec) => ({spec, chart: new Chart(container, spec.id, spec.title)}));
    const render = throttled(draw, 150);
    const view = bindView(() => { for (const {chart} of charts) chart.shape = "?"; draw(); });
    const conn = document.getElementById("conn");

    function draw() {
      for (const name of Object.keys(store)) {  // MoE: one expert-load chart per layer, made when its data arrives
        const layer = name.match(/^expert_share_l(\d+)_e\d+$/)?.[1];
        if (layer !== undefined && !charts.some(({spec}) => spec.id === `experts-l${layer}`)) {
          const spec = {id: `experts-l${layer}`, title: `Expert token share, layer ${layer}`,
                        prefix: `expert_share_l${layer}_`};
          charts.push({spec, chart: new Chart(container, spec.id, spec.title)});
        }
      }
      for (const {spec, chart} of charts) {
        let specLines = spec.lines || [];
        if (spec.prefix) {  // the legend names each line by what follows the prefix (the expert: e0, e1, ...)
          specLines = Object.keys(store).filter((n) => n.startsWith(spec.prefix))
            .map((name) => ({name, label: name.slice(spec.prefix.length)}));
        }
        const lines = specLines.map((l, i) => ({label: l.label || l.name, color: COLORS[i % COLORS.length], series: store[l.name],
                                                dash: l.dash, scale: l.scale}));
        const markers = [];
        if (spec.trips && store[spec.trips]) {
          const s = store[spec.trips];
          s.value.forEach((v, i) => { if (v >= 1) markers.push({x: view.x === "time" ? s.time[i] : s.step[i], color: "#dc2626", label: `trip@${s.step[i]}`}); });
        }
        const hlines = spec.bound && page[spec.bound] != null ? [{y: page[spec.bound]}] : [];
        chart.render(lines, view, markers, hlines);
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
    window.addEventListener("resize", throttled(() => charts.forEach(({chart}) => chart.resize()), 200));
    setConn("connecting");
    connect();
    state.reconnectNow = () => ws && ws.close();  // tests drop the connection to prove the page recovers
  }

  // ---- the compare page: one chart per metric, one line per run --------------------------------------------------
  function comparePage(page) {
    const stores = {};   // run id -> name -> Series
    const container = document.getElementById("charts");
    const charts = COMPARE_METRICS.map((name) => ({name, chart: new Chart(container, name, name)}));
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
