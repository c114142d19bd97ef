"use strict";
// kiln dashboard: polls GET /api/live every second and appends its figures to the charts;
// the chosen range's past comes from GET /api/history when the server keeps history.
// Both endpoints are documented in docs/monitoring.md. Everything is loaded from kiln.
(() => {
  const POLL_MS = 1000;
  const RANGES = { "5m": 300, "1h": 3600, "6h": 21600, "24h": 86400 };
  const COLORS = ["#5fa8ff", "#ff9f43", "#5fd38d", "#c77dff", "#ff6b6b", "#f5e663", "#4dd0e1", "#f78fb3"];
  const MiB = 2 ** 20, GiB = 2 ** 30;
  const $ = (sel) => document.querySelector(sel);

  const modelName = (m) => (m.version ? `${m.model} v${m.version}` : m.model);
  const gpuName = (uuid) => "GPU " + String(uuid).replace(/^GPU-/, "").slice(0, 8);
  // One point per model from a rate (null rates, e.g. no request in the window, are skipped).
  const perModel = (s, pick, suffix = "") =>
    Object.fromEntries((s.models || []).filter((m) => m.rates).map((m) => [modelName(m) + suffix, pick(m.rates)]));
  const perGpu = (s, pick) => Object.fromEntries(s.gpus.map((g) => [gpuName(g.uuid), pick(g)]));
  const scaled = (v, k) => (v == null ? null : v * k);
  const hist = (metric, name, scale = 1) => ({ metric, name, scale });
  const byModel = (suffix = "") => (l) => (l.model ? modelName(l) + suffix : "server" + suffix);
  // The LLM engine's figures are per model (label model_name), not per version.
  const perLLM = (s, pick, suffix = "") => Object.fromEntries((s.llm || []).map((m) => [m.model + suffix, pick(m)]));
  const byLLM = (suffix = "") => (l) => (l.model_name || "llm") + suffix;

  // Chart definitions: live(summary) -> {series: value}; history: /api/history queries.
  const SERVING = [
    { id: "throughput", title: "Throughput (inferences/s)",
      live: (s) => perModel(s, (r) => r.throughput), history: [hist("throughput", byModel())] },
    { id: "latency", title: "Latency p50 / p99 (ms)",
      live: (s) => ({ ...perModel(s, (r) => r.p50_ms, " p50"), ...perModel(s, (r) => r.p99_ms, " p99") }),
      history: [hist("kiln_request_duration_p50_seconds", byModel(" p50"), 1e3),
                hist("kiln_request_duration_p99_seconds", byModel(" p99"), 1e3)] },
    { id: "queue-compute", title: "Queue vs compute per request (µs)",
      live: (s) => ({ ...perModel(s, (r) => r.avg_queue_us, " queue"), ...perModel(s, (r) => r.avg_compute_us, " compute") }),
      history: [hist("avg_queue_us", byModel(" queue")), hist("avg_compute_us", byModel(" compute"))] },
    { id: "batch", title: "Average batch size (inferences per execution)",
      live: (s) => perModel(s, (r) => r.avg_batch_size), history: [hist("avg_batch_size", byModel())] },
  ];
  const LLM = [
    { id: "llm-tokens", title: "LLM generation (tokens/s)",
      live: (s) => perLLM(s, (m) => m.generation_tokens_per_s), history: [hist("llm_generation_tokens_per_s", byLLM())] },
    { id: "llm-kv-cache", title: "LLM KV-cache usage (%)",
      live: (s) => perLLM(s, (m) => scaled(m.kv_cache_usage, 100)), history: [hist("vllm:kv_cache_usage_perc", byLLM(), 100)] },
    { id: "llm-ttft", title: "LLM time to first token p50 / p99 (ms)",
      live: (s) => ({ ...perLLM(s, (m) => m.ttft_p50_ms, " p50"), ...perLLM(s, (m) => m.ttft_p99_ms, " p99") }),
      history: [hist("kiln_llm_time_to_first_token_p50_seconds", byLLM(" p50"), 1e3),
                hist("kiln_llm_time_to_first_token_p99_seconds", byLLM(" p99"), 1e3)] },
    { id: "llm-itl", title: "LLM inter-token latency p50 / p99 (ms)",
      live: (s) => ({ ...perLLM(s, (m) => m.itl_p50_ms, " p50"), ...perLLM(s, (m) => m.itl_p99_ms, " p99") }),
      history: [hist("kiln_llm_inter_token_latency_p50_seconds", byLLM(" p50"), 1e3),
                hist("kiln_llm_inter_token_latency_p99_seconds", byLLM(" p99"), 1e3)] },
    { id: "llm-requests", title: "LLM requests running / waiting",
      live: (s) => ({ ...perLLM(s, (m) => m.running, " running"), ...perLLM(s, (m) => m.waiting, " waiting") }),
      history: [hist("vllm:num_requests_running", byLLM(" running")),
                hist("vllm:num_requests_waiting", byLLM(" waiting"))] },
  ];
  const GPU = [
    { id: "gpu-util", title: "GPU utilization (%)", live: (s) => perGpu(s, (g) => scaled(g.utilization, 100)),
      history: [hist("nv_gpu_utilization", (l) => gpuName(l.gpu_uuid), 100)] },
    { id: "gpu-memory", title: "GPU memory used (GiB)", live: (s) => perGpu(s, (g) => scaled(g.memory_used_bytes, 1 / GiB)),
      history: [hist("nv_gpu_memory_used_bytes", (l) => gpuName(l.gpu_uuid), 1 / GiB)] },
    { id: "gpu-temperature", title: "GPU temperature (°C)", live: (s) => perGpu(s, (g) => g.temperature_celsius),
      history: [hist("kiln_gpu_temperature_celsius", (l) => gpuName(l.gpu_uuid))] },
    { id: "gpu-power", title: "GPU power (W)", live: (s) => perGpu(s, (g) => g.power_watts),
      history: [hist("nv_gpu_power_usage", (l) => gpuName(l.gpu_uuid))] },
  ];
  const CPU = [
    { id: "cpu", title: "CPU utilization (%: host of all cores, kiln of one core)",
      live: (s) => ({ host: scaled(s.host.cpu_utilization, 100), kiln: scaled(s.host.process_cpu_cores, 100) }),
      history: [hist("nv_cpu_utilization", () => "host", 100), hist("process_cpu_seconds_total", () => "kiln", 100)] },
    { id: "rss", title: "kiln process memory (RSS, MiB)",
      live: (s) => ({ "kiln RSS": scaled(s.host.process_rss_bytes, 1 / MiB) }),
      history: [hist("process_resident_memory_bytes", () => "kiln RSS", 1 / MiB)] },
  ];

  const charts = new Map(); // id -> {def, el, body, series: Map(name -> Map(t -> v)), plot, names}
  let rangeS = RANGES["5m"];
  let resourcesKind = null; // "gpu" | "cpu", decided by the first summary
  let last = null; // the latest /api/live summary
  let llmCharts = false; // made when the first llm model shows up

  function makeChart(container, def) {
    const el = document.createElement("div");
    el.className = "chart";
    el.id = "chart-" + def.id;
    el.dataset.points = "0";
    const h = document.createElement("h3");
    h.textContent = def.title;
    const body = document.createElement("div");
    el.append(h, body);
    container.append(el);
    charts.set(def.id, { def, el, body, series: new Map(), plot: null, names: "" });
  }

  function addPoint(chart, name, t, v) {
    if (v == null || !Number.isFinite(v)) return;
    if (!chart.series.has(name)) chart.series.set(name, new Map());
    chart.series.get(name).set(t, v);
  }

  function render(chart) {
    const minT = Date.now() / 1000 - rangeS;
    for (const points of chart.series.values()) for (const t of points.keys()) if (t < minT) points.delete(t);
    const names = [...chart.series.keys()].filter((n) => chart.series.get(n).size).sort();
    const xs = [...new Set(names.flatMap((n) => [...chart.series.get(n).keys()]))].sort((a, b) => a - b);
    const data = [xs, ...names.map((n) => xs.map((t) => chart.series.get(n).get(t) ?? null))];
    chart.el.dataset.points = String(data.slice(1).reduce((k, ys) => k + ys.filter((y) => y != null).length, 0));
    if (!names.length) {
      if (chart.plot) chart.plot.destroy();
      chart.plot = null;
      chart.names = "";
      chart.body.innerHTML = '<div class="empty">no data yet in this range</div>';
      return;
    }
    const key = names.join("\n");
    if (chart.plot && chart.names === key) return chart.plot.setData(data);
    if (chart.plot) chart.plot.destroy();
    chart.body.textContent = "";
    chart.names = key;
    chart.plot = new uPlot(plotOptions(chart, names), data, chart.body);
  }

  function plotOptions(chart, names) {
    const axis = { stroke: "#8a919c", grid: { stroke: "#2c3038" }, ticks: { stroke: "#2c3038" } };
    return {
      width: Math.max(chart.body.clientWidth, 300), height: 200,
      // The x axis always spans the picked range, so a chart's time scale never depends on
      // how much data it has yet.
      scales: { x: { time: true, range: () => [Date.now() / 1000 - rangeS, Date.now() / 1000] }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] } },
      axes: [axis, { ...axis, size: 60 }],
      series: [{}, ...names.map((n, i) => ({ label: n, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true }))],
    };
  }

  function cell(row, text, cls = "") {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.append(td);
  }
  const fmt = (v, digits = 1) => (v == null ? "–" : Number(v).toFixed(digits));

  function renderModels(models) {
    const tbody = $("#models tbody");
    tbody.textContent = "";
    for (const m of models) {
      const tr = document.createElement("tr");
      tr.dataset.model = m.model;
      const t = m.totals || {}, r = m.rates || {};
      cell(tr, m.model);
      cell(tr, m.version || "–");
      cell(tr, m.state || "?", "state-" + m.state);
      if (m.reason) tr.lastChild.title = m.reason;
      cell(tr, t.requests ?? 0, "num requests");
      cell(tr, t.failure ?? 0, "num errors");
      cell(tr, fmt(t.avg_batch_size, 2), "num");
      cell(tr, fmt(r.throughput), "num");
      cell(tr, fmt(r.p99_ms, 2), "num");
      cell(tr, t.pending ?? 0, "num");
      tbody.append(tr);
    }
    if (!models.length) tbody.innerHTML = '<tr><td colspan="9" class="muted">no models in the repository</td></tr>';
  }

  function renderLLM(list) {
    const tbody = $("#llm tbody");
    tbody.textContent = "";
    for (const m of list) {
      const tr = document.createElement("tr");
      tr.dataset.model = m.model;
      cell(tr, m.model);
      cell(tr, m.running, "num running");
      cell(tr, m.waiting, "num waiting");
      cell(tr, fmt(scaled(m.kv_cache_usage, 100)), "num kv-cache");
      cell(tr, fmt(m.prompt_tokens_per_s), "num prompt-tps");
      tr.lastChild.title = `${m.prompt_tokens} prompt tokens since load`;
      cell(tr, fmt(m.generation_tokens_per_s), "num generation-tps");
      tr.lastChild.title = `${m.generation_tokens} generated tokens since load`;
      cell(tr, fmt(scaled(m.prefix_cache_hit_rate, 100)), "num prefix-hit");
      cell(tr, fmt(m.ttft_p50_ms), "num ttft-p50");
      cell(tr, fmt(m.ttft_p99_ms), "num ttft-p99");
      cell(tr, fmt(m.itl_p50_ms), "num itl-p50");
      cell(tr, m.preemptions, "num preemptions");
      tbody.append(tr);
    }
  }

  // Every host's GPUs (kiln serve --monitor-agent / --monitor-prometheus); hidden without.
  function renderFleet(list) {
    $("#fleet-panel").hidden = !list.length;
    const tbody = $("#fleet tbody");
    tbody.textContent = "";
    for (const g of list) {
      const tr = document.createElement("tr");
      tr.dataset.uuid = g.uuid;
      cell(tr, g.host);
      tr.lastChild.title = g.instance || "";
      cell(tr, g.gpu, "num");
      cell(tr, g.model_name || "–");
      cell(tr, fmt(g.utilization_percent, 0), "num util");
      const total = g.memory_used_mib != null && g.memory_free_mib != null
        ? g.memory_used_mib + g.memory_free_mib : null;
      cell(tr, `${fmt(scaled(g.memory_used_mib, 1 / 1024))} / ${fmt(scaled(total, 1 / 1024))}`, "num");
      cell(tr, fmt(g.temperature_celsius, 0), "num temp" + (g.temperature_celsius >= 85 ? " hot" : ""));
      cell(tr, fmt(g.power_watts, 0), "num");
      cell(tr, fmt(g.xid, 0), "num xid" + (g.xid ? " hot" : ""));
      tbody.append(tr);
    }
  }

  // Each model's rollout (docs/rollouts.md): weights, guard steps, shadow agreement.
  function renderRollouts(list) {
    $("#rollouts-panel").hidden = !list.length;
    const tbody = $("#rollouts tbody");
    tbody.textContent = "";
    const pct = (v) => (v == null ? "–" : (100 * v).toFixed(1));
    for (const r of list) {
      const tr = document.createElement("tr");
      const sh = r.shadow || {};
      cell(tr, r.model);
      cell(tr, r.state, r.state === "rolled_back" ? "hot" : "");
      cell(tr, Object.entries(r.weights).map(([v, w]) => `v${v}=${w}`).join(" "));
      cell(tr, r.steps_total.step, "num");
      cell(tr, r.steps_total.rollback, "num" + (r.steps_total.rollback ? " hot" : ""));
      cell(tr, sh.sent ?? "–", "num");
      cell(tr, sh.dropped ?? "–", "num");
      cell(tr, pct(sh.exact_agreement), "num");
      cell(tr, pct(sh.top1_agreement), "num");
      cell(tr, pct(sh.token_agreement), "num tokens");
      cell(tr, sh.max_abs_diff == null ? "–" : Number(sh.max_abs_diff).toPrecision(3), "num");
      cell(tr, fmt(scaled(sh.mean_latency_delta_s, 1000), 2), "num");
      const ev = r.events.length ? r.events[r.events.length - 1] : null;
      cell(tr, ev ? `${ev.result}: ${ev.message}` : "–");
      tbody.append(tr);
    }
  }

  // Shows the LLM section only while an llm model is loaded; returns charts made just now.
  function ensureLLM(s) {
    const list = s.llm || [];
    $("#llm-panel").hidden = !list.length;
    if (!list.length || llmCharts) return [];
    llmCharts = true;
    for (const def of LLM) makeChart($("#llm-charts"), def);
    return LLM.map((def) => charts.get(def.id));
  }

  function renderAlerts(s) {
    const ul = $("#alerts");
    ul.textContent = "";
    const active = s.alerts.filter((a) => a.state !== "resolved")
      .sort((a, b) => (a.state === b.state ? a.name.localeCompare(b.name) : a.state === "firing" ? -1 : 1));
    for (const a of active) {
      const li = document.createElement("li");
      li.className = "alert " + a.state;
      li.dataset.alert = a.name;
      const state = document.createElement("span");
      state.className = "state";
      state.textContent = a.state;
      const labels = Object.entries(a.labels).filter(([k]) => k !== "alertname").map(([k, v]) => `${k}=${v}`).join(" ");
      const text = `${a.name} {${labels}} ${a.annotations.summary || ""} (since ${new Date(a.activeAt).toLocaleTimeString()})`;
      li.append(state, document.createTextNode(text));
      ul.append(li);
    }
    if (!active.length) {
      const li = document.createElement("li");
      li.className = "muted";
      const resolved = s.alerts.length;
      li.textContent = !s.alerting.enabled ? "alerting is off (no rules loaded)"
        : `no alert firing or pending (${s.alerting.rules} rules${resolved ? `, ${resolved} resolved recently` : ""})`;
      ul.append(li);
    }
  }

  function renderNotes(s) {
    const h = s.history, notes = [];
    if (!h.enabled) notes.push("History is off (kiln serve --no-history): charts show what arrived since this page opened.");
    else if (!h.available) notes.push(`History is unavailable (${h.error}): charts show what arrived since this page opened.`);
    if (resourcesKind === "cpu") notes.push("No GPU telemetry on this server: resources show CPU and memory.");
    $("#notes").textContent = notes.join(" ");
  }

  function ensureResources(s) {
    const kind = s.gpus.length ? "gpu" : "cpu";
    if (kind === resourcesKind) return;
    for (const def of resourcesKind === "gpu" ? GPU : resourcesKind === "cpu" ? CPU : []) {
      charts.get(def.id).el.remove();
      charts.delete(def.id);
    }
    resourcesKind = kind;
    $("#resources-title").textContent = kind === "gpu" ? "GPUs" : "Host (no GPU)";
    for (const def of kind === "gpu" ? GPU : CPU) makeChart($("#resource-charts"), def);
  }

  async function poll() {
    let s;
    try {
      const resp = await fetch("/api/live", { cache: "no-store" });
      if (resp.status === 401) return askKey();
      s = await resp.json();
      if (!resp.ok) throw new Error(s.error || "HTTP " + resp.status);
    } catch (err) {
      $("#status").textContent = "cannot read /api/live: " + err.message;
      return;
    }
    const first = last === null;
    last = s;
    ensureResources(s);
    const fresh = ensureLLM(s);
    if (fresh.length && !first) loadHistory(fresh); // an llm model loaded after the page opened
    if (s.window_s > 0) {
      for (const chart of charts.values()) {
        for (const [name, v] of Object.entries(chart.def.live(s))) addPoint(chart, name, s.ts, v);
      }
    }
    charts.forEach(render);
    renderModels(s.models);
    renderLLM(s.llm || []);
    renderFleet(s.fleet || []);
    renderRollouts(s.rollouts || []);
    renderAlerts(s);
    renderNotes(s);
    const when = new Date(s.ts * 1000).toLocaleTimeString();
    $("#status").textContent = `updated ${when} · rates over the last ${fmt(s.window_s, 0)} s`;
  }

  async function loadHistory(only = null) {
    if (!last || !last.history.available) return;
    const range = Object.keys(RANGES).find((k) => RANGES[k] === rangeS);
    const jobs = [];
    for (const chart of only || charts.values()) {
      for (const h of chart.def.history) {
        const url = `/api/history?metric=${encodeURIComponent(h.metric)}&start=now-${range}`;
        jobs.push(fetch(url, { cache: "no-store" }).then((r) => (r.ok ? r.json() : null)).then((res) => {
          for (const series of res ? res.series : []) {
            const name = h.name(series.labels);
            for (const [t, v] of series.points) addPoint(chart, name, t, v == null ? null : v * h.scale);
          }
        }));
      }
    }
    await Promise.allSettled(jobs);
    (only || charts).forEach(render);
  }

  // With API keys, the key is typed into the page's form and sent once in a header to
  // POST /dashboard/session, which sets an HttpOnly cookie for /api/*: never in a URL, where
  // browser history, server logs and Referer headers would keep it.
  function askKey(error = null) {
    $("#status").textContent = "API key needed";
    if (error !== null) $("#login-error").textContent = error; // polls keep the last one
    if ($("#login").hidden) {
      $("#login").hidden = false;
      $("#api-key").focus();
    }
  }

  async function login(event) {
    event.preventDefault();
    const input = $("#api-key");
    let resp;
    try {
      resp = await fetch("/dashboard/session", { method: "POST", headers: { Authorization: "Bearer " + input.value.trim() } });
    } catch (err) {
      return askKey("cannot send the key: " + err.message);
    }
    input.value = "";
    if (!resp.ok) return askKey(resp.status === 401 ? "wrong key" : "HTTP " + resp.status);
    $("#login").hidden = true;
    await poll();
    loadHistory();
  }

  function pickRange(button) {
    document.querySelectorAll("#range button").forEach((b) => b.classList.toggle("active", b === button));
    rangeS = RANGES[button.dataset.range];
    for (const chart of charts.values()) chart.series.clear();
    charts.forEach(render);
    loadHistory();
  }

  $("#login").addEventListener("submit", login);
  document.querySelectorAll("#range button").forEach((b) => b.addEventListener("click", () => pickRange(b)));
  window.addEventListener("resize", () => {
    for (const c of charts.values()) if (c.plot) c.plot.setSize({ width: Math.max(c.body.clientWidth, 300), height: 200 });
  });
  for (const def of SERVING) makeChart($("#serving-charts"), def);
  window.kilnDashboard = { charts, summary: () => last }; // for debugging and the browser test
  poll().then(loadHistory).finally(() => setInterval(poll, POLL_MS));
})();
