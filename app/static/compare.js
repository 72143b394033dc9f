// The compare page: chosen metrics of several runs overlaid (or grouped: mean with a min/max band), a summary table.
"use strict";
Object.assign(Molt, (() => {
  const {COLORS, SECTIONS, axisTitle, activeClock, Series, bindView, Chart} = Molt;
  // shown until the user picks others (kept in the URL's `metrics`)
  const DEFAULT_METRICS = ["reward_mean", "eval_reward", "policy_loss", "grad_norm", "entropy", "response_length",
                           "staleness_mean", "mismatch_kl", "is_filter_ratio", "samples_per_s"];

  // A group's line: at each step any of its runs recorded, the mean of their values, and the min and max as a band.
  // Its time is the runs' mean wall time, or their mean training time (seconds) when x is elapsed.
  function groupLine(members, name, view, page) {
    const at = new Map();  // step -> [values], [times]
    for (const id of members) {
      const s = page.stores[id]?.[name];
      if (!s) continue;
      const clock = activeClock(page.attempts[id] || []);
      s.step.forEach((st, i) => {
        if (!Number.isFinite(s.value[i])) return;
        const e = at.get(st) || at.set(st, [[], []]).get(st);
        e[0].push(s.value[i]); e[1].push(view.x === "elapsed" ? clock(s.time[i]) * 60 : s.time[i]);
      });
    }
    const steps = [...at.keys()].sort((a, b) => a - b);
    const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
    const series = new Series();
    series.merge({step: steps, value: steps.map((st) => mean(at.get(st)[0])), time: steps.map((st) => mean(at.get(st)[1]))});
    return {series, band: {lo: steps.map((st) => Math.min(...at.get(st)[0])), hi: steps.map((st) => Math.max(...at.get(st)[0]))},
            elapsed: (t) => t / 60, runs: Math.max(0, ...steps.map((st) => at.get(st)[0].length))};
  }

  // ---- the compare page: one chart per chosen metric, one line per run (or per group) -----------------------------
  function comparePage(page) {
    page.stores = {};   // run id -> name -> Series
    const container = document.getElementById("charts");
    const params = new URLSearchParams(location.search);
    const chosen = params.get("metrics") ? params.get("metrics").split(",").filter((n) => page.metrics.includes(n))
      : DEFAULT_METRICS.filter((n) => page.metrics.includes(n));
    let defaults = !params.get("metrics");  // until loaded: a default that is constant in every run is dropped
    // "show" (other runs, another grouping) keeps the chosen metrics and the view: they ride along in the form
    const form = document.getElementById("compare-form");
    form.addEventListener("formdata", (e) => {
      const now = new URLSearchParams(location.search);
      for (const key of ["metrics", "x", "smooth", "log"]) if (now.has(key)) e.formData.set(key, now.get(key));
      if (!now.has("metrics") && chosen.length) e.formData.set("metrics", chosen.join(","));
    });
    const charts = {};  // name -> Chart, in the order chosen
    const view = bindView(() => { Object.values(charts).forEach((chart) => chart.shape = "?"); draw(); });
    const state = window.__molt = {charts};

    // the picker: every metric the runs recorded, by the run page's sections, with a filter; the choice goes in the URL
    const picker = document.getElementById("metric-sections"), filter = document.getElementById("metric-filter");
    for (const [id, title, re] of SECTIONS) {
      const names = page.metrics.filter((n) => SECTIONS.find(([, , r]) => r.test(n))[0] === id);
      if (!names.length) continue;
      const set = document.createElement("fieldset");
      set.innerHTML = "<legend></legend>";
      set.querySelector("legend").textContent = title;
      for (const name of names) {
        const label = document.createElement("label");
        label.innerHTML = `<input type="checkbox" name="metric"> <span></span>`;
        label.querySelector("input").value = name; label.querySelector("input").checked = chosen.includes(name);
        label.querySelector("span").textContent = name;
        set.appendChild(label);
      }
      picker.appendChild(set);
    }
    picker.addEventListener("change", (e) => {
      const name = e.target.value;
      if (e.target.checked) chosen.push(name); else chosen.splice(chosen.indexOf(name), 1);
      const p = new URLSearchParams(location.search);
      p.set("metrics", chosen.join(","));
      history.replaceState(null, "", `${location.pathname}?${p}`);
      load();
    });
    filter.addEventListener("input", () => {
      const q = filter.value.trim().toLowerCase();
      for (const label of picker.querySelectorAll("label")) label.hidden = !label.textContent.toLowerCase().includes(q);
    });

    function draw() {
      document.getElementById("picked").textContent = chosen.length ? chosen.join(", ") : "none chosen";
      for (const [name, chart] of Object.entries(charts)) {
        if (!chosen.includes(name)) { chart.plot?.destroy(); chart.root.remove(); delete charts[name]; }
      }
      for (const name of chosen) {
        charts[name] ||= new Chart(container, name, name, {yTitle: axisTitle(name), sync: "compare"});
        container.appendChild(charts[name].root);  // in the order chosen
      }
      const groups = {};  // label -> run ids; a run with several tags is in each tag's group
      for (const id of page.run_ids) {
        for (const label of page.groups[id] ?? [`#${id} ${page.names[id]}`]) (groups[label] ||= []).push(id);
      }
      for (const name of chosen) {
        const lines = Object.entries(groups).map(([label, members], i) => {
          const color = COLORS[i % COLORS.length];
          if (!Object.keys(page.groups).length) {
            const id = members[0];
            return {label, color, series: page.stores[id]?.[name], elapsed: activeClock(page.attempts[id] || [])};
          }
          const g = groupLine(members, name, view, page);
          return {label: `${label} (${members.length} run${members.length === 1 ? "" : "s"}, mean; min-max band)`,
                  color, series: g.series, band: members.length > 1 ? g.band : null, elapsed: g.elapsed};
        });
        charts[name].render(lines, view);
      }
    }

    async function load() {
      const names = chosen.join(",");
      await Promise.all(page.run_ids.map(async (id) => {
        if (!names) return;
        const r = await fetch(`/api/v1/runs/${id}/metrics?max_points=2000&names=${encodeURIComponent(names)}`,
                              {credentials: "same-origin"});
        if (!r.ok) return;
        const body = await r.json();
        page.stores[id] = {};
        for (const [name, s] of Object.entries(body.series)) (page.stores[id][name] = new Series()).merge(s);
      }));
      if (defaults) {  // as the run page folds them: a default metric with one value in every run is not charted
        defaults = false;
        const flat = chosen.filter((name) => {
          const all = page.run_ids.map((id) => page.stores[id]?.[name]).filter((s) => s && s.step.length);
          return all.length && all.every((s) => s.step.length >= 3 && s.value.every((v) => Object.is(v, all[0].value[0])));
        });
        for (const name of flat) {
          chosen.splice(chosen.indexOf(name), 1);
          picker.querySelector(`input[value="${CSS.escape(name)}"]`).checked = false;
        }
        state.constant = flat;
        document.getElementById("constant-note").textContent = flat.length
          ? `(not charted, one value in every run: ${flat.join(", ")})` : "";
      }
      state.loads = (state.loads || 0) + 1;
      draw();
    }
    load();
    setInterval(load, 10000);  // runs still training keep growing
  }

  return {comparePage};
})());
