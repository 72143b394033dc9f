// The compare page: chosen metrics of several runs overlaid (or grouped: mean with a min/max band), a summary table.
"use strict";
Object.assign(Molt, (() => {
  const {COLORS, axisTitle, Series, bindView, Chart} = Molt;
  // shown until the user picks others (the URL's `metrics`)
  const DEFAULT_METRICS = ["reward_mean", "eval_reward", "policy_loss", "grad_norm", "entropy", "response_length",
                           "staleness_mean", "mismatch_kl", "is_filter_ratio", "samples_per_s"];
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

  return {comparePage};
})());
