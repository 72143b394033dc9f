// The charts of the run and compare pages: metric sections and units, the Series store, smoothing, the URL view, and
// a uPlot chart that clips every line to its plot and fits its y-range to the raw points (and a group's band).
"use strict";
Object.assign(Molt, (() => {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
                  "#4b5563", "#65a30d"];
  // The run page charts every recorded metric, one chart per name, in the section its name falls in (first rule
  // that matches; "other" for the rest), so a new metric appears without a code change. A few names join another
  // metric's chart instead: the breaker's threshold and trips join grad_norm, tokens/s joins samples/s on a labelled
  // second axis, the trainer's rss_gb joins the worker's sampled system/rss_gb where there is one (one memory chart;
  // a run without system metrics keeps rss_gb's own), and each MoE layer's expert shares make one chart.
  const SECTIONS = [
    ["system", "System", /^system\//],  // the worker's CPU, memory and GPUs, sampled by the daemon
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
  const JOINS = {breaker_threshold: "grad_norm", breaker_tripped: "grad_norm", tokens_per_s: "samples_per_s",
                 rss_gb: "system/rss_gb"};
  // chat, agent and GPU counters (an eval suite's too) are recorded as 0 by runs that have none: no data unless one is non-zero
  const ONLY_NONZERO = /^([^/]+\/)?(eval_)?(tool_|template_prefix|agent_|gpu_)|^(segments_per_episode|sampling_overrides)$/;
  const UNITS = [[/_gb$/, "GB"], [/^samples_per_s$/, "samples/s"], [/^tokens_per_s$/, "tokens/s"],
                 [/staleness/, "versions"], [/response_length/, "tokens"], [/^lr$/, "learning rate"],
                 [/(_rate|_ratio|_fraction|_share|share_l\d+_e\d+)$|accuracy/, "fraction"], [/_percent$/, "%"],
                 [/_power_w$/, "W"]];
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
    // the worker's samples are taken every few seconds, not per step: on wall time (a step of the page's x would stack
    // a slow step's samples, and a fast run's steps squeeze them), raw unless the chart's own smoothing says otherwise
    if (name.startsWith("system/")) Object.assign(spec, {time: true, smooth: 0});
    if (name === "grad_norm") {
      spec.lines.push({name: "breaker_threshold", label: "breaker threshold", dash: true});
      spec.trips = "breaker_tripped";
      spec.points = true;  // the breaker's chart: raw, with points (smoothing would flatten the spike that tripped it)
      // the joined metrics by their names: the filter and a reader find breaker_threshold and breaker_tripped here
      spec.title = "grad_norm (breaker_threshold dashed; a trip, breaker_tripped: red line with ▼)";
    } else if (name === "samples_per_s") {
      spec.lines.push({name: "tokens_per_s", scale: "y2"});
      spec.y2Title = axisTitle("tokens_per_s");
      spec.title = "samples_per_s, tokens_per_s (right axis)";
    } else if (name === "system/rss_gb") {
      spec.lines.push({name: "rss_gb", label: "rss_gb (the trainer, each step)"});
      spec.title = "system/rss_gb, rss_gb";
    } else if (name === "staleness_max" && page.max_staleness != null) {
      spec.bound = page.max_staleness;
      spec.title = `staleness_max (bound loop.max_staleness = ${page.max_staleness} dashed)`;
    }
    if (name === "breaker_tripped") spec.points = true;
    return spec;
  }

  // Wall time -> minutes of training before it, from a run's attempts ([start, end|null]): the time between attempts
  // (stopped, queued) is left out, so that x = elapsed is training time.
  const activeClock = (attempts) => (t) =>
    attempts.reduce((sum, [start, end]) => sum + Math.max(0, Math.min(t, end ?? Infinity) - start), 0) / 60;

  // JSON carries NaN and the infinities as strings; Number() reads them back.
  const num = (v) => (typeof v === "number" ? v : Number(v));

  // One metric series, kept sorted by step; a step seen again (a replay after resume) replaces its value.
  // Step N is one thing everywhere (records, API, charts, alerts, trackers; docs/dashboard.md): the policy after N
  // optimizer steps. A trainer step's metrics are at its 0-based index (the policy it started from), an evaluation's
  // and the system samples at the steps done; a drill's `spike_at: [30]` is step 30 in the chart, marker and alert.
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

  // The y-range of a scale: every raw point (and band edge) of its shown lines inside the x window, not only the
  // smoothed line, so that a spike is on the chart; a flat series gets a range around its value (uPlot's default for
  // an all-zero series is 0-100). A threshold (a dashed line) is not fitted: one far beyond the data would flatten it
  // (a breaker.abs_max of 1e9 against a spike of 1,000); drawMarks shows it at the edge instead.
  function fitRange(u, scale, extras, log) {
    let min = null, max = null;
    const [i0, i1] = u.series[0].idxs?.length ? u.series[0].idxs : [0, u.data[0].length - 1];  // the x window
    u.series.forEach((s, si) => {
      if (si === 0 || !s.show || s.scale !== scale) return;
      for (const values of extras[si - 1]) {
        for (let i = i0; i <= i1; i++) {
          const v = values[i];
          if (v == null) continue;
          if (min == null || v < min) min = v;
          if (max == null || v > max) max = v;
        }
      }
    });
    if (min == null || max == null) return [0, 1];
    if (log) return uPlot.rangeLog(min, max, 10, true);
    if (min === max) {
      const pad = Math.abs(min) * 0.1 || 1;
      return [min - pad, max + pad];
    }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  // An axis title that fits along a 220 px plot: the unit alone when name and unit are too long (the name is the
  // chart's heading); tick labels get the room their longest label needs, so that they never run into the title.
  const measure = document.createElement("canvas").getContext("2d");
  measure.font = "bold 12px system-ui, sans-serif";  // uPlot's axis label font
  const PLOT_HEIGHT = 150;  // of a 220 px chart, less the x-axis and padding: what a y-axis title may span
  const fitTitle = (title) => (measure.measureText(title).width <= PLOT_HEIGHT ? title
    : title.match(/\(([^)]+)\)$/)?.[1] || `${title.slice(0, 20)}…`);
  const axisSize = (u, values) => (values ? 18 + 7 * Math.max(2, ...values.map((v) => String(v).length)) : 40);

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
      // this chart's own log scale / smoothing (a system chart's: none at first); unset: the page's
      this.local = opts.smooth == null ? {} : {smooth: opts.smooth};
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
    // hlines: [{y, label}]; view: {x, smooth, log, elapsed (wall time -> minutes; else counted from each line's start)};
    // a line's own `elapsed` (a run's attempts, on compare) comes first
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
        const clock = l.elapsed ?? view.elapsed ?? ((t) => (t - s.time[0]) / 60);
        const xs = view.x === "time" ? s.time : view.x === "elapsed" ? s.time.map(clock) : s.step;
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
        const band = l.band ? [l.band.lo, l.band.hi] : [raw.map(() => null), raw.map(() => null)];
        tables.push([xs, smooth ? ema(raw, weight) : raw, raw, ...band]);
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
      // per line: the drawn values, then its raw points and its band's low and high edges (drawn by drawMarks)
      this.raws = []; this.bands = []; this.colors = lines.map((l) => l.color);
      for (let i = 0; i < lines.length; i++) {
        data.push(joined[1 + 4 * i]); this.raws.push(joined[2 + 4 * i]);
        this.bands.push(lines[i].band ? [joined[3 + 4 * i], joined[4 + 4 * i]] : null);
      }
      const extras = this.raws.map((raw, i) => (lines[i].dash ? [] : [raw, ...(this.bands[i] || [])]));
      const range = (scale) => (u) => fitRange(u, scale, this.extras, log);
      const y2 = lines.some((l) => l.scale === "y2");
      // one point (a first eval) alone would sit in a degenerate x-range: the chart spans the run's steps instead
      const single = view.x === "step" && view.steps > 0 && lines.every((l) => l.series.step.length === 1);
      const shape = JSON.stringify([series.map((s) => [s.label, s.smooth, s.points?.show]), view.x, log, y2,
                                    this.bands.map((b) => !!b), single && view.steps]);
      this.markers = markers; this.hlines = hlines;
      this.extras = extras;  // the range functions read the newest through this
      if (this.plot && shape === this.shape) { this.plot.setData(data); return; }
      if (this.plot) this.plot.destroy();
      this.shape = shape;
      const distr = log ? 3 : 1;
      const width = Math.max(300, this.root.clientWidth - 16);
      const axis = {stroke: cssVar("--axis"), size: axisSize, values: tickLabels, grid: {stroke: cssVar("--grid")},
                    ticks: {stroke: cssVar("--grid")}};  // the palette's own colours (light and dark)
      this.plot = new uPlot({
        width, height: 220, series,
        scales: {x: {time: view.x === "time", ...(single ? {range: () => [0, view.steps]} : {})},
                 y: {distr, range: range("y")}, ...(y2 ? {y2: {distr, range: range("y2")}} : {})},
        axes: [{...axis, size: 50, values: view.x === "time" ? undefined : tickLabels, label: X_TITLES[view.x],
                ...(view.x === "step" ? {incrs: STEP_INCRS} : {})},  // whole steps, also on a run of 4 steps
               {...axis, label: fitTitle(this.yTitle)},
               ...(y2 ? [{...axis, scale: "y2", side: 1, grid: {show: false}, label: fitTitle(this.y2Title)}] : [])],
        legend: {live: true},
        cursor: this.sync ? {sync: {key: `${this.sync}-${view.x}`}} : {},  // the charts on the same x follow one cursor
        hooks: {draw: [(u) => this.drawMarks(u)]},
      }, data, this.root.querySelector(".plot"));
      this.root.plot = this.plot;  // tests read its scales and cursor
    }

    drawMarks(u) {
      const ctx = u.ctx, px = devicePixelRatio, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
      ctx.save();
      // everything drawn here stays inside the plot, as uPlot's own lines do: a spike never runs over the axes
      ctx.beginPath(); ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height); ctx.clip();
      u.series.forEach((s, si) => {  // a group's min/max band, filled faint behind its mean line
        const band = this.bands[si - 1];
        if (si === 0 || !s.show || !band) return;
        const pts = [];
        band[0].forEach((lo, i) => {
          if (lo == null || band[1][i] == null) return;
          pts.push([u.valToPos(u.data[0][i], "x", true), u.valToPos(lo, s.scale, true), u.valToPos(band[1][i], s.scale, true)]);
        });
        if (!pts.length) return;
        ctx.fillStyle = alpha(this.colors[si - 1], 0.18);
        ctx.beginPath();
        pts.forEach(([x, , hi], i) => (i ? ctx.lineTo(x, hi) : ctx.moveTo(x, hi)));
        for (let i = pts.length - 1; i >= 0; i--) ctx.lineTo(pts[i][0], pts[i][1]);
        ctx.closePath(); ctx.fill();
      });
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
      const left = u.bbox.left, right = u.bbox.left + u.bbox.width;
      for (const m of this.markers || []) {
        let x = u.valToPos(m.x, "x", true);
        if (!Number.isFinite(x) || x < left - px || x > right + px) continue;
        // a marker on the last step sits on the plot's edge: moved inside by its triangle's half width, not cut
        x = Math.min(Math.max(x, left + (m.trip ? 6 : 1) * px), right - (m.trip ? 6 : 1) * px);
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
      // a threshold beyond the data's range: an arrow and its value at that edge (the range is fitted to the data)
      const edges = [];
      u.series.forEach((s, si) => {
        if (si === 0 || !s.show || !s.dash) return;
        const values = this.raws[si - 1].filter((v) => v != null);
        const {min, max} = u.scales[s.scale];
        if (values.length && values.every((v) => v > max)) edges.push({above: true, label: `${s.label} ${tickLabels(u, [values[values.length - 1]])[0]}`});
        else if (values.length && values.every((v) => v < min)) edges.push({above: false, label: `${s.label} ${tickLabels(u, [values[values.length - 1]])[0]}`});
      });
      for (const h of this.hlines || []) {
        const {min, max} = u.scales.y;
        if (h.y > max || h.y < min) edges.push({above: h.y > max, label: h.label});
      }
      this.root.dataset.edges = edges.map((e) => `${e.above ? "above" : "below"}: ${e.label}`).join("; ");
      for (const e of edges) {
        ctx.fillStyle = getComputedStyle(this.root).color; ctx.font = `${11 * px}px sans-serif`;
        ctx.textAlign = "right"; ctx.textBaseline = e.above ? "top" : "bottom";
        ctx.fillText(`${e.above ? "▲" : "▼"} ${e.label} (off the chart)`, right - 4 * px, e.above ? top + 2 * px : bottom - 2 * px);
      }
      ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
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

  // uPlot's default labels round tiny values (a KL of 2e-5) to "0": exponents at the extremes, and then on every label
  // of the axis (a log axis read "1.0e+9" beside "10000")
  function tickLabels(u, splits) {
    const exp = splits.some((v) => v != null && v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e5));
    return splits.map((v) => (v == null ? "" : exp && v !== 0 ? (+v.toPrecision(4)).toExponential() : String(+v.toPrecision(4))));
  }
  const STEP_INCRS = [1, 2, 5].flatMap((m) => Array.from({length: 10}, (_, e) => m * 10 ** e)).sort((a, b) => a - b);

  return {COLORS, SECTIONS, JOINS, ONLY_NONZERO, X_TITLES, axisTitle, chartSpec, activeClock, Series, ema, bindView, fmt, Chart};
})());
