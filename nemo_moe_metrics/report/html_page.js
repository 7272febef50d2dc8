// The page of `nemo-moe-metrics report --html`: reads the run's data (the JSON element
// #nmm-data, written by nemo_moe_metrics/report/html.py), builds the sections and draws the
// charts with the inlined vega-embed. Nothing is fetched: the data and the runtime are here.
(() => {
  "use strict";
  const DATA = JSON.parse(document.getElementById("nmm-data").textContent);
  const SPECS = DATA.specs;
  // Tests and curious users read the charts through these (view.scenegraph(), view.data()).
  const nmm = { data: DATA, views: {}, firstChartMs: null, done: false, errors: [], timings: {} };
  const mark = (name) => { nmm.timings[name] = Math.round(performance.now()); };
  mark("script");
  window.nmm = nmm;
  // The specs are Vega already (compiled by html_specs.compiled): nothing to compile here.
  const EMBED = { mode: "vega", actions: false, renderer: "canvas" };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  }
  const fmt = (x, d = 4) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toPrecision(d));
  const body = document.body;

  // --- arrays packed by html_data.packed: base64 of zlib of byte-shuffled little-endian ---
  function bytesOf(b64) {
    if (Uint8Array.fromBase64) return Uint8Array.fromBase64(b64);
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  async function unpack(p) {
    const stream = new Blob([bytesOf(p.b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    const raw = new Uint8Array(await new Response(stream).arrayBuffer());
    const size = p.dtype === "uint32" ? 4 : 8;
    const n = raw.length / size;
    if (size === 4) {  // one pass: the four byte planes, low byte first
      const out = new Uint32Array(n);
      for (let i = 0; i < n; i++) out[i] = (raw[i] | (raw[n + i] << 8) | (raw[2 * n + i] << 16) | (raw[3 * n + i] << 24)) >>> 0;
      return out;
    }
    const bytes = new Uint8Array(raw.length);
    for (let b = 0; b < size; b++) {
      const plane = b * n;
      for (let i = 0; i < n; i++) bytes[i * size + b] = raw[plane + i];
    }
    return new Float64Array(bytes.buffer);
  }

  // The first render must have its data: a quantitative axis over no data sizes the view to
  // an infinite extent, which Vega does not shrink back. So the values go into the spec.
  function withValues(spec, data) {
    const copy = { ...spec, data: spec.data.map((d) => (d.name in data && !d.source ? { ...d, values: data[d.name] } : d)) };
    return copy;
  }
  // Promises chain in one task: without a real yield the browser would paint nothing until
  // every chart is drawn. After each chart, a frame (the chart shows) and a task boundary.
  const nextFrame = () => new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
  async function draw(id, container, data) {
    const { view } = await vegaEmbed(container, withValues(SPECS[id], data || {}), EMBED);
    nmm.views[id] = view;
    await nextFrame();
    if (nmm.firstChartMs === null) nmm.firstChartMs = performance.now();  // its frame painted
    return view;
  }
  async function update(id, data) {
    const view = nmm.views[id];
    if (!view) return;
    for (const [name, values] of Object.entries(data)) view.data(name, values);
    await view.runAsync();
  }
  const section = (title, note) => {
    const s = el("section", {}, el("h2", { text: title }));
    if (note) s.append(el("p", { class: "note", text: note }));
    body.append(s);
    return s;
  };
  const alertMarks = DATA.alerts.marks.map(([step, kind, layer, expert, message]) => ({ step, kind, layer, expert, message }));

  // --- header and summary ---
  body.append(el("h1", { text: `${DATA.run}: MoE training report` }));
  const span = DATA.first_step === DATA.last_step ? `step ${DATA.first_step}` : `steps ${DATA.first_step}–${DATA.last_step} (${DATA.logged.toLocaleString("en-US")} logged)`;
  body.append(el("p", { class: "meta", text: `${span}; written by nemo-moe-metrics report --html; runtime ${DATA.runtime}, inlined (no network).` }));
  body.append(el("pre", { id: "summary", text: DATA.summary }));

  // --- expert counts: heatmap, picked layer, per-layer series ---
  const C = DATA.counts;
  let state = null;

  function binLabel(a, b) {
    const first = C.first[a], last = C.last[b];
    return first === last ? `${first}` : `${first}–${last}`;
  }
  function windowBins() {
    const b = Number(document.getElementById("step").value);
    const w = Math.max(1, Math.min(Number(document.getElementById("window").value) || 1, b + 1));
    return [b - w + 1, b];
  }
  function cellsFor(a, b) {
    const { counts, streak } = state;
    const L = C.layers.length, E = C.experts, steps = binLabel(a, b), out = [];
    for (let l = 0; l < L; l++) {
      const width = C.widths[l], tokens = new Float64Array(width);
      let total = 0;
      for (let k = a; k <= b; k++) {
        const base = (k * L + l) * E;
        for (let e = 0; e < width; e++) tokens[e] += counts[base + e];
      }
      for (let e = 0; e < width; e++) total += tokens[e];
      const sbase = (b * L + l) * E;
      for (let e = 0; e < width; e++) {
        const t = tokens[e], ratio = total > 0 ? (t * width) / total : 0;
        out.push({
          layer: C.layers[l], expert: e, tokens: t, load: total > 0 ? (100 * t) / total : 0,
          ratio, lr: t > 0 ? Math.log2(ratio) : 0, streak: streak[sbase + e], steps,
        });
      }
    }
    return out;
  }
  function layerCells(layer) {
    const { counts, streak } = state;
    const l = C.layers.indexOf(layer), L = C.layers.length, E = C.experts, width = C.widths[l], out = [];
    for (let k = 0; k < C.first.length; k++) {
      const base = (k * L + l) * E;
      let total = 0;
      for (let e = 0; e < width; e++) total += counts[base + e];
      for (let e = 0; e < width; e++) {
        const t = counts[base + e], ratio = total > 0 ? (t * width) / total : 0;
        out.push({
          layer, expert: e, x0: C.first[k] - 0.5, x1: C.last[k] + 0.5, steps: binLabel(k, k), tokens: t,
          load: total > 0 ? (100 * t) / total : 0, ratio, lr: t > 0 ? Math.log2(ratio) : 0,
          streak: streak[base + e],
        });
      }
    }
    return out;
  }
  const centre = (k) => (C.first[k] + C.last[k]) / 2;
  function statLines(stat, layer) {
    const shown = C.worst_first.slice(0, 6);
    if (!shown.includes(layer)) shown.push(layer);
    const out = [];
    for (const la of shown) {
      const values = C.stats[stat][C.layers.indexOf(la)];
      values.forEach((y, k) => { if (y !== null) out.push({ x: centre(k), y, series: `layer ${la}` + (la === layer ? " (picked)" : "") }); });
    }
    return out;
  }

  async function showWindow() {
    const [a, b] = windowBins();
    const first = C.first[a], last = C.last[b];
    document.getElementById("step-label").textContent =
      `steps ${binLabel(a, b)} (bin${a === b ? "" : "s"} ${a === b ? b + 1 : `${a + 1}–${b + 1}`} of ${C.first.length}; ${C.size.slice(a, b + 1).reduce((s, x) => s + x, 0)} logged step(s) summed)`;
    const win = [{ x0: first - 0.5, x1: last + 0.5 }];
    // Every view's data is set before any await: a quicker second move cannot interleave.
    await Promise.all([
      update("heatmap", { cells: cellsFor(a, b) }),
      ...["layer_steps", "moi", "cv", "dead"].map((id) => update(id, { window: win })),
    ]);
  }
  async function pickLayer(layer) {
    state.layer = layer;
    document.getElementById("layer").value = String(layer);
    document.getElementById("layer-title").textContent = `Layer ${layer}: each expert's load over the step bins`;
    for (const tr of document.querySelectorAll("table.worst tr[data-layer]")) tr.classList.toggle("picked", Number(tr.dataset.layer) === layer);
    await Promise.all([
      update("heatmap", { pick: [{ layer }] }),
      update("layer_steps", { lcells: layerCells(layer) }),
      ...[["moi", "max_over_ideal"], ["cv", "cv"], ["dead", "dead"]].map(([id, stat]) => update(id, { lines: statLines(stat, layer) })),
    ]);
  }

  async function countsSection() {
    if (!C) {
      section("Expert load", "No expert-load counts in this run (no expert_loads.bin, no moe/expert_loads rows): the summary above says which flag logs them.");
      return;
    }
    state = { counts: await unpack(C.counts), streak: await unpack(C.streak), layer: C.picked };
    mark("unpacked");
    const n = C.first.length;
    const rule = C.width === 1
      ? "one bin per logged step."
      : `${C.logged.toLocaleString("en-US")} logged steps in ${n} bins of ${C.width} consecutive logged steps (the last may hold fewer), tokens summed; bins merge pairwise as in the report's expert_load_over_steps.png, to keep this page under 8 MB. Narrow the window with report --steps FIRST:LAST for finer bins.`;
    const s = section("Expert load: MoE layer × expert", `Colour: the expert's load over the ideal (tokens × experts / the layer's tokens) on a log2 scale; white balanced, red overloaded, blue underloaded, black 0 tokens; values beyond the colour scale take its end colours. Hover a cell for its numbers; click a row to pick its layer. Steps: ${rule}`);
    const controls = el("div", { class: "controls" });
    const slider = el("input", { id: "step", type: "range", min: "0", max: String(n - 1), value: String(n - 1), step: "1" });
    const windowInput = el("input", { id: "window", type: "number", min: "1", max: String(n), value: "1" });
    const picker = el("select", { id: "layer" });
    for (const la of C.layers) picker.append(el("option", { value: String(la), text: `layer ${la}` }));
    controls.append(
      el("label", {}, "step", slider), el("label", {}, "bins summed", windowInput),
      el("span", { id: "step-label" }), el("label", {}, "layer", picker),
    );
    const heat = el("div", { id: "chart-heatmap" });
    s.append(controls, heat);
    const [a, b] = [n - 1, n - 1];
    document.getElementById("step-label").textContent = `steps ${binLabel(a, b)}`;
    const cells = cellsFor(a, b);
    mark("cells");
    const view = await draw("heatmap", heat, { cells, pick: [{ layer: C.picked }] });
    view.addEventListener("click", (_, item) => {
      if (item && item.datum && item.datum.layer !== undefined) pickLayer(item.datum.layer);
    });

    const detail = section("Picked layer over steps");
    detail.querySelector("h2").id = "layer-title";
    const lchart = el("div", { id: "chart-layer_steps" });
    detail.append(lchart);
    const win = [{ x0: C.first[n - 1] - 0.5, x1: C.last[n - 1] + 0.5 }];
    await draw("layer_steps", lchart, { lcells: layerCells(C.picked), window: win });

    const per = section("Per layer over steps: max/ideal, CV, dead experts", "Lines: the 6 worst layers by mean max/ideal and the picked one, from each bin's summed tokens; grey band: the steps the heatmap shows; red dashes: alerts (hover them).");
    const table = el("table", { class: "worst" });
    table.append(el("tr", {}, ...["rank", "layer", "mean max/ideal", "worst max/ideal", "mean CV", "dead experts (last bin)"].map((t) => el("th", { text: t }))));
    C.worst_first.slice(0, 20).forEach((la, i) => {
      const l = C.layers.indexOf(la), moi = C.stats.max_over_ideal[l].filter((v) => v !== null);
      const cv = C.stats.cv[l].filter((v) => v !== null), dead = C.stats.dead[l];
      const mean = (xs) => (xs.length ? xs.reduce((s, x) => s + x, 0) / xs.length : null);
      const tr = el("tr", { "data-layer": String(la) }, ...[i + 1, la, fmt(mean(moi)), fmt(moi.length ? Math.max(...moi) : null), fmt(mean(cv)), dead[dead.length - 1] ?? "–"].map((t) => el("td", { text: String(t) })));
      tr.addEventListener("click", () => pickLayer(la));
      table.append(tr);
    });
    const grid = el("div", { class: "grid" });
    per.append(el("h3", { text: `Worst layers first (of ${C.layers.length})` }), table, grid);
    for (const [id, stat, title] of [["moi", "max_over_ideal", "max/ideal"], ["cv", "cv", "coefficient of variation"], ["dead", "dead", "dead experts"]]) {
      const holder = el("div");
      grid.append(el("div", { id: `chart-${id}` }, el("h3", { text: title }), holder));
      await draw(id, holder, { lines: statLines(stat, C.picked), window: win, alerts: alertMarks });
    }
    slider.addEventListener("input", showWindow);
    windowInput.addEventListener("input", showWindow);
    picker.addEventListener("change", () => pickLayer(Number(picker.value)));
    await pickLayer(C.picked);
    await showWindow();
  }

  async function scalarSection() {
    if (!DATA.scalars.length) return;
    const note = DATA.scalar_width === 1 ? "One point per logged step." : `Each point is the mean of ${DATA.scalar_width} consecutive logged steps (at most 512 points per series).`;
    const s = section("Over steps: throughput, compute, aux losses, router health, routing", `${note} Red dashes: alerts (${DATA.alerts.total}${DATA.alerts.total > DATA.alerts.marks.length ? `, the first ${DATA.alerts.marks.length} marked` : ""}); hover them for the message.`);
    const grid = el("div", { class: "grid" });
    s.append(grid);
    for (const chart of DATA.scalars) {
      const div = el("div", { id: `chart-${chart.id}` }, el("h3", { text: chart.title }));
      grid.append(div);
      const lines = [];
      for (const [series, values] of Object.entries(chart.series)) {
        values.forEach((y, k) => { if (y !== null) lines.push({ x: DATA.scalar_steps[k], y, series }); });
      }
      const holder = el("div");
      div.append(holder);
      await draw(chart.id, holder, { lines, alerts: alertMarks });
    }
  }

  async function loadCells(p) {
    const tokens = await unpack(p.tokens);
    const [L, E] = p.tokens.shape, out = [];
    for (let l = 0; l < L; l++) {
      let total = 0;
      for (let e = 0; e < E; e++) total += tokens[l * E + e];
      for (let e = 0; e < E; e++) {
        const t = tokens[l * E + e], ratio = total > 0 ? (t * E) / total : 0;
        out.push({ layer: p.layers[l], expert: e, tokens: t, load: total > 0 ? (100 * t) / total : 0, ratio, lr: t > 0 ? Math.log2(ratio) : 0, steps: `${p.first}–${p.last}` });
      }
    }
    return out;
  }
  async function placementSection() {
    const P = DATA.placement;
    if (!P.length) return;
    const phases = Object.fromEntries(P.map((p) => [p.phase, p]));
    if (phases.train && phases.rollout) {
      const s = section("Rollout vs training load", "Each expert's load over the ideal, summed over the last stored steps of each phase, on one colour scale.");
      const grid = el("div", { class: "grid" });
      s.append(grid);
      for (const p of [phases.train, phases.rollout]) {
        const div = el("div", { id: `chart-${p.phase}_loads` }, el("h3", { text: `${p.phase === "train" ? "training" : "rollout engine"}: steps ${p.first}–${p.last} (${p.logged} stored)` }));
        grid.append(div);
        const holder = el("div");
        div.append(holder);
        await draw(`${p.phase}_loads`, holder, { cells: await loadCells(p) });
      }
    } else if (!DATA.rollout_store) {
      section("Rollout vs training load", "No rollout loads in this run (rollout_expert_loads.bin): feed them with RolloutLoadRecorder or nemo-moe-metrics ingest sglang.");
    }
    const s = section("Expert placement (EPLB)", "Balancedness = mean GPU load / max GPU load (1 = every GPU equally busy). Sweep: DeepSeek's EPLB with R redundant experts; plan: per layer, today's contiguous placement against EPLB's. nemo-moe-metrics placement RUN_DIR --ep-size G --sweep plans for your G.");
    const grid = el("div", { class: "grid" });
    s.append(grid);
    for (const p of P) {
      const gpus = `${p.ep_size} GPUs${p.known ? "" : " (assumed: run.json names no expert_model_parallel_size)"}`;
      const sweep = [];
      for (const row of p.sweep) {
        const b = row.balancedness.filter((v) => v !== null);
        sweep.push({ x: row.r, y: b.reduce((s, v) => s + v, 0) / b.length, series: "EPLB, mean over layers" });
        sweep.push({ x: row.r, y: Math.min(...b), series: "EPLB, worst layer" });
        const today = p.today.filter((v) => v !== null);
        sweep.push({ x: row.r, y: today.reduce((s, v) => s + v, 0) / today.length, series: "today (contiguous), mean" });
      }
      const plan = [];
      const after = p.sweep.find((row) => row.r === p.plan_r) || p.sweep[0];
      p.layers.forEach((la, i) => {
        plan.push({ x: la, y: p.today[i], series: "today (contiguous)" });
        plan.push({ x: la, y: after.balancedness[i], series: `EPLB, R=${p.plan_r}` });
      });
      for (const [id, title, values] of [["sweep", `${p.phase} loads, steps ${p.first}–${p.last}: sweep over R, ${gpus}`, sweep], ["plan", `${p.phase} loads: before / after per layer (R=${p.plan_r})`, plan]]) {
        const div = el("div", { id: `chart-${p.phase}_${id}` }, el("h3", { text: title }));
        grid.append(div);
        const holder = el("div");
        div.append(holder);
        await draw(`${p.phase}_${id}`, holder, { lines: values });
      }
    }
  }

  (async () => {
    try {
      await countsSection();
      await scalarSection();
      await placementSection();
      nmm.done = true;
    } catch (err) {
      nmm.errors.push(String(err && err.stack ? err.stack : err));
      body.append(el("p", { class: "error", text: `This page failed to draw: ${err}` }));
      console.error(err);
    }
  })();
})();
