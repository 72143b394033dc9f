// The run page: a live chart per recorded metric (over the run's websocket) in collapsible sections, the overview strip.
"use strict";
Object.assign(Molt, (() => {
  const {COLORS, SECTIONS, JOINS, ONLY_NONZERO, chartSpec, Series, bindView, fmt, Chart, activeClock,
         duration, throttled, toast} = Molt;
  // ---- the run page ----------------------------------------------------------------------------------------------
  function runPage(page) {
    const store = {};           // name -> Series
    let lastStep = -1, retry = 0, status = null, ws = null;
    const knownAlerts = new Set();
    // what tests (and curious users) can read: received alerts with their arrival time, messages, reconnects, charts
    const charts = {};          // chart id -> {spec, chart, section}
    const state = window.__molt = {alerts: [], messages: 0, connects: 0, pageLoadedAt: Date.now(), charts};
    const container = document.getElementById("charts");
    // remembered across runs and reloads (localStorage): closed sections, pinned and hidden charts
    const saved = (key) => new Set(JSON.parse(localStorage.getItem(key) || "[]"));
    const save = (key, set) => localStorage.setItem(key, JSON.stringify([...set]));
    const closed = saved("molt-closed-sections"), pinned = saved("molt-pinned-charts"), hidden = saved("molt-hidden-charts");
    const unfolded = new Set();  // constant metrics the user opened as charts (this page only)
    const sections = {};
    const order = ["pinned", "reward", "suites", "loss", "staleness", "throughput", "memory", "system", "env", "agent",
                   "moe", "other"];
    for (const [id, title] of [["pinned", "Pinned"], ...SECTIONS].sort((a, b) => order.indexOf(a[0]) - order.indexOf(b[0]))) {
      const el = sections[id] = document.createElement("details");
      el.className = "chart-section"; el.id = `section-${id}`; el.hidden = true; el.open = !closed.has(id);
      el.innerHTML = `<summary><h2></h2></summary><div class="charts"></div>`;
      el.querySelector("h2").textContent = title;
      el.addEventListener("toggle", () => {
        if (el.open) closed.delete(id); else closed.add(id);
        save("molt-closed-sections", closed);
        if (el.open) Object.values(charts).forEach(({chart, section}) => section === id && chart.resize());
      });
      container.appendChild(el);
    }
    const folded = document.getElementById("folded");  // the constant metrics and the hidden charts, as one-line lists
    const render = throttled(draw, 150);
    const view = bindView(() => { for (const {chart} of Object.values(charts)) chart.shape = "?"; draw(); });
    const conn = document.getElementById("conn");
    // elapsed time counts training only: the time between attempts (stopped, queued) is left out, and each resume is
    // marked on that axis
    const clock = () => (page.attempts.length ? activeClock(page.attempts) : (t) => (t - (page.started_at ?? t)) / 60);
    view.elapsed = clock();
    view.steps = Number(document.getElementById("run-step").textContent);  // a one-point chart spans these

    // a chart per recorded name (chartSpec), made when the name's first data arrives, kept in name order
    function ensureChart(name) {
      const spec = chartSpec(name, store, page);
      if (!spec || charts[spec.id]) return;
      const section = SECTIONS.find(([, , re]) => re.test(name))[0];
      const list = sections[pinned.has(spec.id) ? "pinned" : section].querySelector(".charts");
      const before = [...list.children].find((el) => el.id > `chart-${spec.id}`);
      const chart = new Chart(list, spec.id, spec.title, {before, yTitle: spec.yTitle, y2Title: spec.y2Title, sync: "run",
                                                          smooth: spec.smooth});
      charts[spec.id] = {spec, section, chart};
      const head = chart.root.querySelector(".chart-head");
      head.insertAdjacentHTML("beforeend", `<button type="button" class="small" data-act="pin"></button>
        <button type="button" class="small" data-act="hide">hide</button>`);
      head.addEventListener("click", (e) => {
        const act = e.target.dataset?.act;
        if (act === "pin") {
          if (pinned.has(spec.id)) pinned.delete(spec.id); else pinned.add(spec.id);
          save("molt-pinned-charts", pinned);
        }
        if (act === "hide") { hidden.add(spec.id); save("molt-hidden-charts", hidden); }
        if (act) draw();
      });
      for (const [joined, into] of Object.entries(JOINS)) if (into === name && charts[joined]) removeChart(joined);
    }

    function removeChart(id) {  // a name that joined another chart (its own chart came first)
      charts[id].chart.plot?.destroy(); charts[id].chart.root.remove(); delete charts[id];
    }

    const hasData = (name) => store[name] && store[name].step.length &&
      (!ONLY_NONZERO.test(name) || store[name].value.some((v) => v !== 0));
    // a metric that never changed (3 points or more, one value): listed with its value instead of a flat chart (the
    // reward and eval suite sections are always charted: a flat reward is the run's outcome)
    const constant = (s) => s.step.length >= 3 && s.value.every((v) => Object.is(v, s.value[0]));

    function draw() {
      for (const name of Object.keys(store)) ensureChart(name);
      const query = view.q.toLowerCase(), constants = [], hiddenShown = [];
      for (const [id, {spec, chart, section}] of Object.entries(charts)) {
        const home = sections[pinned.has(id) ? "pinned" : section];
        if (chart.root.parentElement !== home.querySelector(".charts")) home.querySelector(".charts").appendChild(chart.root);
        home.hidden = false;  // laid out, so that a new chart gets the width of its column
        chart.root.querySelector("[data-act=pin]").textContent = pinned.has(id) ? "unpin" : "pin";
        let specLines = spec.lines || [];
        if (spec.prefix) {  // the legend names each line by what follows the prefix (the expert: e0, e1, ...)
          specLines = Object.keys(store).filter((n) => n.startsWith(spec.prefix))
            .map((name) => ({name, label: name.slice(spec.prefix.length)}));
        }
        const names = specLines.map((l) => l.name).concat(spec.trips && store[spec.trips] ? [spec.trips] : []);
        chart.root.dataset.metrics = names.filter((n) => store[n]).join(" ");
        // a counter that stayed 0 (ONLY_NONZERO) is drawn only once opened from the constants line
        const drawn = specLines.filter((l) => hasData(l.name) || (unfolded.has(id) && store[l.name]?.step.length));
        if (query && !names.some((n) => n.toLowerCase().includes(query)) && !spec.title.toLowerCase().includes(query)) {
          chart.root.hidden = true;
          continue;
        }
        if (hidden.has(id)) { chart.root.hidden = true; hiddenShown.push(id); continue; }
        const zeros = specLines.filter((l) => store[l.name]?.step.length && !hasData(l.name));
        if (!drawn.length && zeros.length) {  // findable by its name all the same: "tool_errors = 0"
          chart.root.hidden = true;
          constants.push([id, zeros.map((l) => `${l.name} = 0`).join(", ")]);
          continue;
        }
        if (drawn.length && !["reward", "suites"].includes(section) && !pinned.has(id) && !unfolded.has(id) &&
            drawn.every((l) => constant(store[l.name]))) {
          chart.root.hidden = true; chart.root.dataset.points = String(store[drawn[0].name].step.length);
          constants.push([id, drawn.map((l) => `${l.name} = ${fmt(store[l.name].value[0])}`).join(", ")]);
          continue;
        }
        const lines = drawn.map((l, i) => ({
          label: l.label || l.name, color: COLORS[i % COLORS.length], series: store[l.name], dash: l.dash,
          scale: l.scale, points: spec.points && !l.dash}));
        const markers = [], x = spec.time && view.x === "step" ? "time" : view.x;  // the worker's samples: on time
        const xOf = (s, i) => (x === "time" ? s.time[i] : x === "elapsed" ? view.elapsed(s.time[i]) : s.step[i]);
        if (spec.trips && store[spec.trips]) {
          const s = store[spec.trips];
          s.value.forEach((v, i) => {
            if (v >= 1) markers.push({x: xOf(s, i), color: "#dc2626", label: `trip@${s.step[i]}`, trip: true});
          });
        }
        if (x !== "step") {
          page.attempts.slice(1).forEach(([start], i) => markers.push({
            x: x === "time" ? start : view.elapsed(start), color: "#6b7280", label: `resumed (attempt ${i + 2})`}));
        }
        const hlines = spec.bound != null ? [{y: spec.bound, label: `bound ${spec.bound}`}] : [];
        chart.render(lines, x === view.x ? view : {...view, x}, markers, hlines);
      }
      for (const [id, el] of Object.entries(sections)) {
        el.hidden = !Object.values(charts).some((c) => el.contains(c.chart.root) && !c.chart.root.hidden);
      }
      showFolded(constants, hiddenShown);
      if (Object.keys(store).length) container.classList.remove("loading");
      showOverview();
    }

    // one line each: the constant metrics with their value, the hidden charts; a click shows that chart again
    function showFolded(constants, hiddenShown) {
      const key = JSON.stringify([constants, hiddenShown]);
      if (folded.dataset.key === key) return;
      folded.dataset.key = key;
      folded.replaceChildren();
      for (const [title, items, click] of [
        ["constant", constants, ([id]) => { unfolded.add(id); draw(); }],
        ["hidden", hiddenShown.map((id) => [id, id]),
         ([id]) => { hidden.delete(id); save("molt-hidden-charts", hidden); draw(); }]]) {
        if (!items.length) continue;
        const p = document.createElement("p");
        p.className = `folded-${title}`; p.append(`${title}: `);
        items.forEach((item, i) => {
          const b = document.createElement("button");
          b.type = "button"; b.className = "link"; b.dataset.chart = item[0]; b.textContent = item[1];
          b.title = title === "constant" ? "show its chart" : "show this chart again";
          b.onclick = () => click(item);
          p.append(...(i ? [" · ", b] : [b]));
        });
        folded.append(p);
      }
    }

    // the overview strip: training time (the attempts' own time, not the time queued or stopped) and the ETA from it
    function showOverview() {
      state.overviews = (state.overviews || 0) + 1;
      const elapsed = document.getElementById("ov-elapsed"), eta = document.getElementById("ov-eta");
      if (!elapsed) return;
      // the duration every page and the API show (daemon/records.py, training_seconds), counted live
      const live = ["running", "restarting", "stopping", "unreachable"].includes(page.status), running = page.status === "running";
      const now = Date.now() / 1000;  // a run with no attempt of its own (reported from elsewhere): start to end
      const secs = page.attempts.length ? page.attempts.reduce((sum, [start, end]) =>
        sum + Math.max(0, (end ?? (live ? now : page.finished_at ?? start)) - start), 0)
        : page.started_at ? (page.finished_at ?? now) - page.started_at : null;
      elapsed.textContent = secs == null ? "—" : duration(secs);
      const step = Number(document.getElementById("run-step").textContent), total = page.total_steps;
      const WORDS = {completed: "done", queued: "queued", stopped: "stopped", tripped: "tripped", failed: "failed"};
      eta.textContent = WORDS[page.status] ??
        (running && step > 0 && step < total ? duration(secs / step * (total - step)) : "—");
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
      el("run-step").textContent = run.step; el("run-progress").value = run.step; view.steps = run.step;
      el("run-version").textContent = run.version; el("run-restarts").textContent = run.restarts;
      el("run-alerts").textContent = run.alerts_open; el("run-alerts").className = run.alerts_open ? "badge" : "";
      el("run-error").hidden = !run.last_error; el("run-error").textContent = run.last_error || "";
      page.started_at = run.started_at; page.finished_at = run.finished_at; page.status = run.status;
      // a status without attempts (an older server's backfill) keeps what the page has
      if (run.attempts && JSON.stringify(run.attempts) !== JSON.stringify(page.attempts)) {
        page.attempts = run.attempts; view.elapsed = clock(); render();
      }
      if (el("ov-pid")) el("ov-pid").textContent = run.pid ?? "—";
      const note = el("queue-note");
      if (run.status !== "queued" && note?.classList.contains("waiting")) {  // at once, beside the new badge
        note.className = "queue-note left"; note.textContent = `Left the queue: ${run.status}.`;
        htmx.trigger(document.body, "refresh-queue");
      }
      if (status !== null && status !== run.status) {
        htmx.trigger(document.body, "refresh-actions"); htmx.trigger(document.body, "refresh-records");
        if (run.status === "queued") htmx.trigger(document.body, "refresh-queue");  // back in the queue: its note
      }
      status = run.status;
    }

    function handle(msg) {
      state.messages++;
      if (msg.type === "status") showRun(msg.run);
      else if (msg.type === "metrics") {
        for (const [name, s] of Object.entries(msg.series)) {
          (store[name] ||= new Series()).merge(s);
          lastStep = Math.max(lastStep, s.step.length ? s.step[s.step.length - 1] : -1);  // as recorded (after_step)
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

  return {runPage};
})());
