// The job page: fetches its figures from /api/job/<part>?id=<job> and draws them with Plotly.
"use strict";
const CFG = window.TRAINSCOPE;
const state = { suspects: [], metric: null, bucketMs: 0 };

// The job id goes in the query: it carries any id ("/", "#", "..", "." included).
function api(part, params = {}) {
  return `/api/job/${part}?${new URLSearchParams({id: CFG.job_id, ...params})}`;
}

async function getJSON(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: ${response.status} ${await response.text()}`);
  return response.json();
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                  '"': "&quot;", "'": "&#39;"}[c]));
}

// Text from producers (job ids, function names, messages) goes into Plotly escaped: Plotly
// renders <a href>, <b> and a few other tags in labels, titles and hover text.
const plain = escapeHtml;

// A section without data says, in one line, what would fill it.
function empty(id, text) {
  const box = document.getElementById(id);
  if (box.data) { Plotly.purge(box); delete box.dataset.bound; }
  const note = document.createElement("p");
  note.className = "empty";
  note.textContent = text;
  box.replaceChildren(note);
}

function plot(id, traces, layout) {
  const box = document.getElementById(id);
  box.querySelectorAll(":scope > .empty").forEach(e => e.remove());
  return Plotly.react(box, traces, layout, {responsive: true});
}

function drawSteps(steps, marks) {
  if (!steps.length) {
    empty("steps", "No step records yet: they come with the job's windows, from trainscope.attach() " +
                   "in the training script through trainscope pipeline.");
    return;
  }
  const x = steps.map(s => new Date(s.t_ms));
  const traces = [
    {x, y: steps.map(s => s.mean_ms), name: "mean over ranks", mode: "lines"},
    {x, y: steps.map(s => s.max_ms), name: "slowest rank", mode: "lines",
     text: steps.map(s => `step ${s.step}, slowest rank ${s.slowest_rank}`)},
  ];
  if (marks.length) {
    const top = Math.max(...steps.map(s => s.max_ms));
    traces.push({x: marks.map(m => new Date(m.t_ms)), y: marks.map(() => top * 1.02),
                 name: "findings", mode: "markers", marker: {color: "#b91c1c", symbol: "triangle-down", size: 10},
                 text: marks.map(m => plain(m.top_message)), hoverinfo: "x+text"});
  }
  const shapes = CFG.from_ms ? [{type: "rect", xref: "x", yref: "paper", x0: new Date(CFG.from_ms),
    x1: new Date(CFG.to_ms || CFG.from_ms), y0: 0, y1: 1, fillcolor: "#fde68a", opacity: .4, line: {width: 0}}] : [];
  plot("steps", traces, {margin: {t: 10, r: 10}, yaxis: {title: "ms per step"},
                         legend: {orientation: "h"}, shapes});
}

function drawHeatmap(heat) {
  state.bucketMs = heat.bucket_ms;
  const [rankOf, colOf, valueOf] = heat.cells;
  if (!rankOf.length) {
    empty("heatmap", state.metric
      ? `No summaries of ${state.metric} for this job: pick another metric.`
      : "No step records yet: the rank × time map fills as the job's windows close.");
    return;
  }
  const ranks = [...new Set(rankOf)].sort((a, b) => a - b);
  let columns = 0;
  for (const c of colOf) columns = Math.max(columns, c + 1);
  const times = Array.from({length: columns}, (_, i) => heat.t0_ms + i * heat.bucket_ms);
  const row = new Map(ranks.map((r, i) => [r, i]));
  const z = ranks.map(() => new Array(columns).fill(null));
  for (let i = 0; i < rankOf.length; i++) z[row.get(rankOf[i])][colOf[i]] = valueOf[i];
  const shapes = state.suspects.filter(r => row.has(r)).map(r => ({
    type: "rect", xref: "paper", yref: "y", x0: 0, x1: 1, y0: r - 0.5, y1: r + 0.5,
    line: {color: "#b91c1c", width: 2}, fillcolor: "rgba(0,0,0,0)"}));
  const unit = state.metric ? `% of time in ${plain(state.metric)}` : "step time, ms";
  plot("heatmap", [{type: "heatmap", x: times.map(t => new Date(t)), y: ranks, z,
                            colorscale: "YlOrRd", reversescale: true, colorbar: {title: {text: unit}},
                            hovertemplate: `rank %{y}<br>%{x}<br>%{z:.1f} ${state.metric ? "%" : "ms"}<extra></extra>`}],
               {margin: {t: 10, r: 10}, yaxis: {title: "rank", autorange: "reversed"}, shapes});
  const heatmap = document.getElementById("heatmap");
  heatmap.dataset.suspects = state.suspects.join(",");
  if (!heatmap.dataset.bound) {
    heatmap.dataset.bound = "1";
    heatmap.on("plotly_click", event => {
      const point = event.points[0];
      const t = new Date(point.x).getTime();
      openBreakdown(point.y, t, t + state.bucketMs);
    });
  }
}

async function openBreakdown(rank, fromMs, toMs) {
  const data = await getJSON(api("breakdown", {rank, from_ms: fromMs, to_ms: toMs}));
  const rows = data.rows.slice(0, 15);
  document.getElementById("breakdown").dataset.rank = rank;
  if (!rows.length) {
    empty("breakdown", `No function summaries of rank ${rank} in that time column: click another cell.`);
    return;
  }
  const names = rows.map(r => plain(`${r.layer}/${r.name}`));
  const peers = rows.length ? rows[0].peers : 0;
  await plot("breakdown", [
    {type: "bar", name: `rank ${rank}`, x: names, y: rows.map(r => r.rank_ms), marker: {color: "#b91c1c"}},
    {type: "bar", name: `median of ${peers} peers`, x: names, y: rows.map(r => r.peer_median_ms), marker: {color: "#9ca3af"}},
  ], {barmode: "group", margin: {t: 40, r: 10},
      title: {text: `rank ${rank} vs its peers, ${new Date(fromMs).toISOString()} – ${new Date(toMs).toISOString()}`},
      yaxis: {title: "ms per step"}});
}

// The call path the automatic profile of the finding's rank and a peer found, if one came back.
function callPath(p, category) {
  if (!p) return "";
  const ms = (p.delta_ns / 1e6).toFixed(1);
  const unit = p.per_step ? " ms/step" : ` ms over ${p.steps} steps`;
  const asked = p.profiled_for === category ? "" : `, profiled on its ${escapeHtml(p.profiled_for)} finding`;
  return `<div class="callpath">call path (vs rank ${p.peer_rank}${asked}): ` +
    `<code>${escapeHtml(p.path.join(" → "))}</code> +${ms}${unit}</div>`;
}

function drawFindings(findings) {
  const box = document.getElementById("findings");
  if (!findings.length) {
    empty("findings", `No findings: the detectors raised nothing for this job at or above ${CFG.threshold}.`);
    return;
  }
  const rows = findings.map(f => `<tr class="finding" data-rank="${f.rank}">
    <td>${f.rank >= 0 ? f.rank : (f.pp_stage >= 0 ? "stage " + f.pp_stage : "job")}</td>
    <td>${escapeHtml(f.category)}</td><td>${escapeHtml(f.function_name)}</td><td>${f.max_score}</td>
    <td>${f.windows}</td><td>${f.first}<br>${f.last}</td><td>${escapeHtml(f.all_victims.join(", "))}</td>
    <td>${escapeHtml(f.top_message)}${callPath(f.call_path, f.category)}<div class="evidence">${escapeHtml(f.detectors)}: ${escapeHtml(JSON.stringify(f.top_evidence))}</div></td></tr>`);
  box.innerHTML = `<table><thead><tr><th>rank</th><th>category</th><th>function</th><th>score</th>
    <th>windows</th><th>first / last</th><th>victims</th><th>message and evidence</th></tr></thead>
    <tbody>${rows.join("")}</tbody></table>`;
}

function drawWhatif(w, hint) {
  const box = document.getElementById("whatif");
  if (!w) { empty("whatif", `No what-if yet: ${hint}`); return; }
  const warnings = w.warnings.length ? `<p class="alert">${w.warnings.map(escapeHtml).join("<br>")}</p>` : "";
  const stages = [...new Set(w.S_worker.map(c => c.stage))].sort((a, b) => a - b);
  // With one pipeline stage the last stage is the whole job: M_S says nothing there.
  const ms = stages.length === 1 ? "M_S: one pipeline stage, no stage to blame"
                                 : `M_S = ${w.M_S.toFixed(2)} (last stage)`;
  box.innerHTML = `<p>Analysed ${w.analysed_at}: ${w.steps} steps, ${w.workers} workers.
    Slowdown S = <b>${w.S.toFixed(3)}</b> (real ${(w.step_time_real_s * 1e3).toFixed(1)} ms/step,
    without stragglers ${(w.step_time_ideal_s * 1e3).toFixed(1)} ms/step);
    M_W = ${w.M_W.toFixed(2)} (few slow workers), ${ms}.</p>${warnings}`;
  const dps = [...new Set(w.S_worker.map(c => c.dp_rank))].sort((a, b) => a - b);
  const z = stages.map(s => dps.map(d => (w.S_worker.find(c => c.stage === s && c.dp_rank === d) || {}).score ?? null));
  if (!w.S_worker.length) return;
  plot("workers", [{type: "heatmap", x: dps, y: stages, z, colorscale: "YlOrRd", reversescale: true, zmin: 1, zmax: 1.5,
                            hovertemplate: "dp %{x}, stage %{y}: %{z:.3f}<extra></extra>"}],
               {margin: {t: 10, r: 10}, xaxis: {title: "DP rank", dtick: 1}, yaxis: {title: "stage", dtick: 1}});
}

// Functions that appear while a job runs are added on each refresh; the metric the top finding
// names is picked on the first load only, so a refresh never overrides the user's choice.
function fillMetrics(functions, findings) {
  const select = document.getElementById("metric");
  const first = !select.options.length;
  if (first) {
    select.add(new Option("step time", ""));
    select.addEventListener("change", () => loadHeatmap());
  }
  const have = new Set([...select.options].map(o => o.value));
  const named = first && findings.find(f => f.function_name && f.function_name.includes("/"));
  for (const f of functions) {
    const value = `${f.layer}/${f.name}`;
    if (f.layer === "step" || have.has(value)) continue;
    select.add(new Option(value, value, false, Boolean(named) && named.function_name === value));
  }
}

async function loadHeatmap() {
  const value = document.getElementById("metric").value;
  state.metric = value || null;
  const [layer, ...rest] = value ? value.split("/") : ["", ""];
  drawHeatmap(await getJSON(api("heatmap", value ? {layer, name: rest.join("/")} : {})));
}

function drawHeader(job) {
  const status = document.getElementById("status");
  status.textContent = job.status;
  status.className = `status ${job.status}`;
  const data = job.first === null ? "no step records yet" :
    `${job.ranks} ranks, steps 0–${job.last_step}, ${job.first} to ${job.last}`;
  const whatif = job.whatif_at === null ? "" : ` What-if analysed ${job.whatif_at}.`;
  document.getElementById("summary").textContent = `${data}; ${job.open_findings} open ` +
    `finding(s), ${job.suspects} suspect(s) at or above ${CFG.threshold}.${whatif}`;
}

async function load() {
  const overview = await getJSON(api("overview"));
  drawHeader(overview.job);
  state.suspects = [...new Set(overview.findings.filter(f => f.rank >= 0).map(f => f.rank))];
  document.getElementById("suspects").textContent = state.suspects.length
    ? `suspect rank(s): ${state.suspects.join(", ")}` : "";
  drawSteps(overview.steps, overview.marks);
  fillMetrics(overview.functions, overview.findings);
  drawFindings(overview.findings);
  drawWhatif(overview.whatif, overview.whatif_hint);
  await loadHeatmap();
  document.getElementById("refreshed").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
  document.body.dataset.loaded = "1";
  document.body.dataset.loads = String(Number(document.body.dataset.loads || 0) + 1);
  return overview.job.status;
}

async function refreshLoop() {
  let status = "unknown";
  try { status = await load(); } catch (error) { console.error(error); document.getElementById("refreshed").textContent = String(error); }
  // A failed load (the store changing owners: 503) is tried again, as a running job is.
  if (status === "running" || status === "unknown") setTimeout(refreshLoop, CFG.refresh_s * 1000);
}

window.openBreakdown = openBreakdown;
refreshLoop();
