// verlj view: the pages, drawn from the server's JSON (engine/post_mortem/view/server.py).
// No framework, no build step, nothing fetched from elsewhere. Every text from a run goes in as
// textContent, never as HTML.
"use strict";

const BOOT = JSON.parse(document.getElementById("boot").textContent);
const main = document.getElementById("main");
const COLORS = ["#1f6feb", "#d1495b", "#2a9d8f", "#e09f3e", "#6a4c93"];

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const k of kids.flat()) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
  return e;
}

function svg(tag, attrs, ...kids) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids.flat()) if (k) e.append(k);
  return e;
}

async function get(path) {
  const r = await fetch(path, { headers: { Accept: "application/json" } });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

const enc = encodeURIComponent;
const runUrl = (run) => `/run/${enc(run)}/`;
const stepUrl = (run, n) => `/run/${enc(run)}/step/${n}`;
const fmt = (v) => (v === null || v === undefined ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(5)) : String(v));

function kv(rows) {
  return el("table", { class: "kv" }, rows.filter((r) => r).map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", {}, v instanceof Node ? v : fmt(v)))));
}

function page(...kids) {
  main.replaceChildren(...kids.filter((k) => k !== null && k !== undefined));
}

function fail(where, err) {
  where.replaceChildren(el("p", { class: "badge bad", id: "error", text: String(err.message || err) }));
}

function navigation() {
  const nav = document.getElementById("nav");
  for (const r of BOOT.runs) nav.append(el("a", { href: runUrl(r.name), text: r.name }));
  if (BOOT.runs.length > 1) nav.append(el("a", { href: "/compare", text: "compare" }));
  nav.append(el("a", { href: `/run/${enc(BOOT.run || BOOT.runs[0].name)}/search`, text: "search" }));
}

// ----------------------------------------------------------------------------- charts (SVG)

// series: [{name, color, points: [[step, value], ...]}]; mark: a step to draw a line at (or null)
function chart(title, series, mark, onStep) {
  const W = 360, H = 170, L = 60, R = 8, T = 8, B = 22;
  const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null));
  const box = el("div", { class: "chart", "data-metric": title });
  box.append(el("h3", { text: title }));
  if (!pts.length) {
    box.append(el("p", { class: "muted", text: "no values" }));
    return box;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": title });
  g.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  const label = (x, y, s, anchor) => { const t = svg("text", { x, y, "text-anchor": anchor }); t.textContent = s; return t; };
  g.append(label(L - 4, Y(y1) + 8, fmt(y1), "end"), label(L - 4, Y(y0), fmt(y0), "end"));
  g.append(label(L, H - 6, `step ${x0}`, "start"), label(W - R, H - 6, `step ${x1}`, "end"));
  if (mark !== null && mark !== undefined && mark >= x0 && mark <= x1) g.append(svg("line", { class: "mark", x1: X(mark), y1: T, x2: X(mark), y2: H - B }));
  for (const s of series) {
    const p = s.points.filter((q) => q[1] !== null);
    if (p.length > 1) g.append(svg("polyline", { fill: "none", stroke: s.color, "stroke-width": 1.6, points: p.map((q) => `${X(q[0])},${Y(q[1])}`).join(" ") }));
    if (p.length <= 120) for (const [x, y] of p) {
      const c = svg("circle", { cx: X(x), cy: Y(y), r: 2.6, fill: s.color });
      const t = svg("title"); t.textContent = `${s.name} step ${x}: ${fmt(y)}`; c.append(t);
      if (onStep) c.addEventListener("click", () => onStep(s.name, x));
      g.append(c);
    }
  }
  if (onStep && p0(series)) g.addEventListener("click", (ev) => {  // a long run draws no dots: the nearest step to the click
    if (ev.target.tagName === "circle") return;
    const r = g.getBoundingClientRect(), x = x0 + ((ev.clientX - r.left) / r.width * W - L) / (W - L - R) * (x1 - x0);
    const s = p0(series);
    const near = s.points.reduce((a, q) => (Math.abs(q[0] - x) < Math.abs(a[0] - x) ? q : a));
    onStep(s.name, near[0]);
  });
  box.append(g);
  if (series.length > 1) box.append(el("div", { class: "legend" }, series.map((s) => el("span", { style: `color:${s.color}`, text: `■ ${s.name}` }))));
  return box;
}

const p0 = (series) => series.find((s) => s.points.length);

// metrics: {run: {names, rows}}; chosen: names to draw
function drawCharts(where, metrics, chosen, mark) {
  const runs = Object.keys(metrics);
  where.replaceChildren(...chosen.map((name) => chart(name, runs.map((run, i) => ({
    name: run, color: COLORS[i % COLORS.length], points: metrics[run].rows.map((r) => [r.step, r[name] ?? null]),
  })), mark, (run, step) => { location.href = stepUrl(run, step); })));
}

function chooser(where, names, chosen, onChange) {
  const open = where.querySelector("details")?.open;
  where.replaceChildren(el("details", { class: "card", open }, el("summary", { text: `choose metrics (${chosen.length} of ${names.length} shown)` }),
    el("div", { class: "chooser" }, names.map((n) => el("label", {}, el("input", {
      type: "checkbox", value: n, checked: chosen.includes(n),
      onchange: (e) => { if (e.target.checked) chosen.push(n); else chosen.splice(chosen.indexOf(n), 1); onChange(); },
    }), " " + n)))));
}

function defaultCharts(names, preferred) {
  const got = preferred.filter((n) => names.includes(n));
  return got.length ? got : names.slice(0, 6);
}

// ----------------------------------------------------------------------------- the run at a glance

async function runPage(run) {
  const s = await get(`/api/run/${enc(run)}/summary`);
  const m = await get(`/api/run/${enc(run)}/metrics?after=0`);
  document.title = `${run} · verlj view`;
  const cfg = s.config || {};
  const actor = ((cfg.model || {}).actor || {}).model_name_or_path;
  const cf = s.counterfactual;
  const lastStep = el("strong", { id: "last-step", text: fmt(s.last_step) });
  const committed = el("span", { id: "steps-committed", text: fmt(s.steps_committed) });
  const verifyOut = el("div", { id: "verify" }, el("button", { id: "verify-button", onclick: () => verify(run, verifyOut) }, "verify now"),
    el("span", { class: "muted", text: " reads the journal's hash chain and each snapshot's manifest" }));
  const snaps = s.snapshots.length ? el("span", {}, s.snapshots.map((x) => el("span", { class: `badge ${x.valid ? "ok" : "bad"}`, title: x.problem || "", text: x.name }), " ")) : "none";
  page(
    el("h1", {}, `run ${run} `, el("span", { class: "muted mono", text: s.run })),
    cf ? el("p", { class: "badge warn", text: `what-if of ${cf.run}: steps ${cf.from_step + 1}–${cf.to_step} re-trained on its samples` }) : null,
    el("div", { class: "card" }, kv([
      ["last step", el("span", {}, lastStep, " · ", committed, " committed")],
      ["config", el("span", { class: "mono", text: `hash ${s.config_hash} · ${(cfg.algorithm || {}).name} · zero ${(cfg.distributed || {}).zero_stage} · actor ${actor}` })],
      ["rollout", `${s.rollout.engine}${s.rollout.version ? " " + s.rollout.version : ""}${s.rollout.mode ? " · " + s.rollout.mode : ""}`],
      ["ranks", s.world_size],
      ["created", s.created],
      ["snapshots", snaps],
      ["writer", s.writer ? `pid ${s.writer.pid} on ${s.writer.host} (epoch ${s.writer.epoch}${s.writer.released ? ", released" : ""})` : "–"],
      ["lineage", s.lineage.filter((e) => e.kind !== "start").map((e) => e.kind).join(", ") || "–"],
      ["verify", verifyOut],
      ["full config", el("details", {}, el("summary", { text: "show" }), el("pre", { text: JSON.stringify(cfg, null, 2) }))],
    ])),
  );
  const state = { metrics: { [run]: m }, chosen: defaultCharts(m.names, s.default_charts) };
  const charts = el("div", { class: "charts", id: "charts" });
  const pick = el("div", {});
  const steps = el("div", { class: "card steps-list", id: "steps" });
  const redraw = () => {
    chooser(pick, state.metrics[run].names, state.chosen, redraw);
    drawCharts(charts, state.metrics, state.chosen, null);
    stepTable(steps, run, state.metrics[run].rows);
  };
  main.append(el("h2", { text: "metrics" }), pick, charts, el("h2", { text: "steps" }), steps);
  redraw();
  live(run, state, (last, n) => { lastStep.textContent = fmt(last); committed.textContent = fmt(n); redraw(); });
}

function stepTable(where, run, rows) {
  const cols = ["critic/score/mean", "actor/pg_loss", "response_length/mean"];
  where.replaceChildren(el("table", { class: "grid" },
    el("tr", {}, el("th", { text: "step" }), cols.map((c) => el("th", { text: c }))),
    rows.slice().reverse().slice(0, 500).map((r) => el("tr", {}, el("td", {}, el("a", { href: stepUrl(run, r.step), text: `step ${r.step}` })),
      cols.map((c) => el("td", { text: fmt(r[c]) }))))));
}

// Poll for the steps committed since the last one shown: new steps appear without a reload.
function live(run, state, onNew) {
  const badge = document.getElementById("live");
  const tick = async () => {
    const have = state.metrics[run].rows;
    const after = have.length ? have[have.length - 1].step : 0;
    try {
      const m = await get(`/api/run/${enc(run)}/metrics?after=${after}`);
      badge.textContent = `live · checked ${new Date().toLocaleTimeString()}`;
      if (m.rows.length) {
        const all = state.metrics[run];
        all.rows.push(...m.rows);
        all.names = [...new Set([...all.names, ...m.names])].sort();
        onNew(all.rows[all.rows.length - 1].step, all.rows.length);
      }
    } catch (e) {
      badge.textContent = `not live: ${e.message}`;
    }
    setTimeout(tick, BOOT.poll * 1000);
  };
  setTimeout(tick, BOOT.poll * 1000);
}

async function verify(run, where) {
  where.replaceChildren(el("span", { class: "muted", text: "verifying…" }));
  try {
    const v = await get(`/api/run/${enc(run)}/verify`);
    where.replaceChildren(el("span", { class: `badge ${v.ok ? "ok" : "bad"}`, text: v.ok ? `OK at step ${v.last_step}` : "DAMAGED" }), el("pre", { text: v.text }));
  } catch (e) {
    fail(where, e);
  }
}

// ----------------------------------------------------------------------------- one step

function shade(lp) {
  // a token's generation probability: the less likely, the redder
  const p = Math.exp(lp);
  return `rgba(209,73,91,${(0.55 * (1 - p)).toFixed(3)})`;
}

function tokensView(tokens, fallback) {
  if (!tokens) return el("div", { class: "tokens", text: typeof fallback === "string" ? fallback : JSON.stringify(fallback) });
  return el("div", { class: "tokens" }, tokens.map(([text, lp, policy]) => policy
    ? el("span", { class: "tok", style: `background:${shade(lp)}`, title: `log-prob ${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(3)})`, text })
    : el("span", { class: "tok obs", title: "the environment's (masked out of the loss)", text })));
}

const UNRESOLVED = 6; // schema.sample.EnvEnd.UNRESOLVED: a tool call's outcome unknown after a crash (rollout.tools)

function episodeView(s) {
  if (!s.turns) return null;
  const ended = s.env_end === UNRESOLVED ? "ended unresolved, never trained on" : "ended by a fault";
  return el("div", { class: "turns" }, s.turns.map((t, i) => el("div", { class: "turn" },
    el("span", { class: "n", text: `turn ${i + 1}` }), el("span", { class: "mono", text: JSON.stringify(t.action) }), " ⇒ ",
    el("span", { class: "obs mono", text: JSON.stringify(t.observation) }),
    t.reward === null ? null : el("span", { class: "badge", text: `reward ${fmt(t.reward)}` }))),
  (s.tools || []).map((t, i) => el("div", { class: "turn tool" },
    el("span", { class: "n", text: `tool ${i + 1}` }), el("span", { class: "mono", text: `${t.name}(${t.arguments})` }), " → ",
    el("span", { class: "obs mono", text: t.state === "sent" ? "(sent; its outcome unknown)" : t.result }),
    el("span", { class: t.error || t.state === "sent" ? "badge bad" : "badge", text: `${t.effect}, ${t.state}, attempt ${t.attempt}` }),
    el("span", { class: "badge mono", title: "its idempotency key: the same on every attempt", text: t.key }))),
  s.env_reason ? el("div", { class: "badge bad", text: `${ended}: ${s.env_reason}` }) : null);
}

function groupsView(d) {
  const consumed = new Set(d.buffer.consumed), dropped = new Set(d.buffer.dropped);
  const groups = new Map();
  for (const s of d.samples) { if (!groups.has(s.group)) groups.set(s.group, []); groups.get(s.group).push(s); }
  return [...groups.entries()].map(([g, ss]) => {
    const scores = ss.map((s) => s.score);
    const mean = scores.reduce((a, b) => a + b, 0) / scores.length;
    return el("div", { class: "group", "data-group": g },
      el("div", { class: "head" }, el("strong", { text: `group ${g}` }), el("span", { text: `row ${ss[0].index}` }),
        el("span", { text: `mean score ${fmt(mean)}` }), el("span", { class: "muted", text: `${ss.length} samples` })),
      el("div", { class: "sample" }, el("div", { class: "meta", text: "prompt" }), el("div", { class: "prompt mono", text: typeof ss[0].prompt === "string" ? ss[0].prompt : JSON.stringify(ss[0].prompt) })),
      ss.map((s) => el("div", { class: "sample", "data-sample": s.id, id: `sample-${s.id}` },
        el("div", { class: "meta" }, el("span", { text: `sample ${s.id}` }), el("span", { class: "badge", text: `score ${fmt(s.score)}` }),
          el("span", { text: `rule ${fmt(s.rule_reward)} · rm ${fmt(s.rm_score)} · policy v${s.policy_version}` }),
          consumed.has(s.id) ? el("span", { class: "badge ok", text: "consumed" }) : dropped.has(s.id) ? el("span", { class: "badge warn", text: "dropped" }) : null),
        tokensView(s.tokens, s.response), episodeView(s))));
  });
}

async function stepPage(run, n) {
  const d = await get(`/api/run/${enc(run)}/step/${n}`);
  document.title = `${run} step ${n} · verlj view`;
  const ro = d.rollout;
  page(
    el("h1", {}, el("a", { href: runUrl(run), text: run }), ` · step `, el("span", { id: "step-number", text: String(n) }), " ",
      n > d.first_step ? el("a", { href: stepUrl(run, n - 1), class: "muted", id: "previous", text: "◀ previous" }) : null, " ",
      n < d.last_step ? el("a", { href: stepUrl(run, n + 1), class: "muted", id: "next", text: "next ▶" }) : null),
    el("div", { class: "card" }, kv([
      ["fingerprint", el("span", { class: "mono", id: "fingerprint", text: d.fingerprint || "–" })],
      ["committed", new Date(d.time * 1000).toISOString()],
      ["data rows", el("span", { class: "mono", text: `epoch ${fmt(d.data.epoch)} · cursor ${fmt(d.data.cursor)} · rounds ${fmt(d.data.rounds)} · indices ${JSON.stringify(d.data.indices)}` })],
      ["seeds", el("span", { class: "mono", id: "seeds", text: d.seeds ? Object.entries(d.seeds).map(([k, v]) => `${k} ${v}`).join(" · ") : "–" })],
      ["generator states", el("span", { class: "mono", text: d.rng_digests ? Object.entries(d.rng_digests).map(([k, v]) => `${k} ${v}`).join(" · ") : "–" })],
      ["rollout", ro ? `${ro.engine} ${ro.version || ""}${ro.mode ? " · " + ro.mode : ""}` : "–"],
      ["buffer", `added ${d.buffer.added} · dropped ${d.buffer.dropped.length} · consumed ${d.buffer.consumed.length}`],
      d.control.length ? ["control", el("pre", { text: JSON.stringify(d.control, null, 1) })] : null,
      d.eval ? ["held-out eval", `${d.eval.rows.length} prompts, score ${fmt(d.eval.score_mean)}`] : null,
      d.samples_note ? ["samples", d.samples_note] : null,
    ])),
    el("h2", {}, `samples (${d.samples.length}), by group `, el("span", { class: "scale" }, "log-prob: likely", el("i"), "unlikely")),
    el("div", { id: "samples" }, groupsView(d)),
    el("h2", { text: "metrics" }),
    el("div", { class: "card" }, el("table", { class: "grid mono", id: "step-metrics" }, Object.keys(d.metrics).sort().map((k) => el("tr", {}, el("td", { text: k }), el("td", { text: fmt(d.metrics[k]) }))))),
  );
  const target = location.hash && document.getElementById(location.hash.slice(1));  // a search's link to one sample
  if (target) target.scrollIntoView();
}

// ----------------------------------------------------------------------------- two runs

function diffSummary(d) {
  if (d.identical) return el("p", { id: "divergence", class: "badge ok", text: `identical: the runs agree on all ${d.steps_a} steps (timings aside)` });
  if (d.differs.length === 1 && d.differs[0] === "length") return el("p", { id: "divergence", text: `the runs agree up to step ${d.step - 1}; ${d.a} has ${d.steps_a} steps, ${d.b} has ${d.steps_b}` });
  const st = d.detail.stages;
  const e = st && st.element;
  return el("div", { class: "card diverge" },
    el("p", { id: "divergence" }, el("strong", { text: `first difference at step ${d.step}` }), `: ${d.differs.join(", ")}`),
    st ? el("p", { id: "stage", text: `first differing stage: ${st.stage}` + (e ? ` (consumed sample #${e.consumed}, ${e.field}[${e.index}]: ${fmt(e.a)} vs ${fmt(e.b)})` : "") }) : null,
    Object.keys(d.config).length ? el("p", { class: "mono", text: "config: " + Object.entries(d.config).map(([k, [a, b]]) => `${k} ${JSON.stringify(a)} vs ${JSON.stringify(b)}`).join("; ") }) : null,
    Object.keys(d.environment).length ? el("p", { class: "mono", text: "environment: " + Object.entries(d.environment).map(([k, [a, b]]) => `${k} ${a} vs ${b}`).join("; ") }) : null);
}

async function comparePage(a, b) {
  document.title = `${a} vs ${b} · verlj view`;
  let [d, ma, mb, sa] = await Promise.all([get(`/api/compare/${enc(a)}/${enc(b)}`), get(`/api/run/${enc(a)}/metrics?after=0`),
    get(`/api/run/${enc(b)}/metrics?after=0`), get(`/api/run/${enc(a)}/summary`)]);
  let names = [...new Set([...ma.names, ...mb.names])].sort();
  const state = { metrics: { [a]: ma, [b]: mb }, chosen: defaultCharts(names, sa.default_charts) };
  const charts = el("div", { class: "charts", id: "charts" });
  const pick = el("div", {});
  const redraw = () => { names = [...new Set([...state.metrics[a].names, ...state.metrics[b].names])].sort(); chooser(pick, names, state.chosen, redraw); drawCharts(charts, state.metrics, state.chosen, d.identical ? null : d.step); };
  const last = Math.min(d.steps_a, d.steps_b);
  const at = el("input", { type: "number", min: 1, max: Math.max(d.steps_a, d.steps_b), value: d.identical || d.step > last ? last : d.step, id: "side-step" });
  const side = el("div", { class: "side", id: "side" });
  const showSide = async () => {
    const n = Number(at.value);
    side.replaceChildren(el("p", { class: "muted", text: "loading…" }));
    const col = async (run) => {
      try {
        const s = await get(`/api/run/${enc(run)}/step/${n}`);
        return el("div", { "data-run": run }, el("h3", {}, el("a", { href: stepUrl(run, n), text: `${run} step ${n}` })),
          el("div", { class: "mono muted", text: `fingerprint ${s.fingerprint}` }), groupsView(s));
      } catch (e) {
        return el("div", { "data-run": run }, el("h3", { text: run }), el("p", { class: "badge bad", text: e.message }));
      }
    };
    side.replaceChildren(...(await Promise.all([col(a), col(b)])));
  };
  const verdict = el("div", {}, diffSummary(d));
  main.replaceChildren(el("h1", {}, el("a", { href: runUrl(a), text: a }), " vs ", el("a", { href: runUrl(b), text: b })),
    verdict, el("h2", { text: "metrics, overlaid" }), pick, charts,
    el("h2", {}, "samples side by side at step ", at, " ", el("button", { onclick: showSide }, "show")), side);
  redraw();
  showSide();
  const again = async () => {  // either run committed a step: where they part may have changed
    try { d = await get(`/api/compare/${enc(a)}/${enc(b)}`); verdict.replaceChildren(diffSummary(d)); } catch (e) { fail(verdict, e); }
    redraw();
  };
  live(a, state, again);
  if (b !== a) live(b, state, again);
}

// ----------------------------------------------------------------------------- search

async function searchPage(run) {
  document.title = `search ${run} · verlj view`;
  const q = new URLSearchParams(location.search);
  const field = (name, label, hint) => el("label", {}, label, el("input", { type: "text", name, value: q.get(name) || "", placeholder: hint }));
  const form = el("form", { class: "search card", method: "get", action: location.pathname },
    field("where", "metrics (as verlj find --where)", "critic/score/mean > 0.5 and actor/grad_norm < 10"),
    field("text", "text in a prompt or response", "e.g. 42"), field("score", "sample score", "> 0.5"),
    el("label", {}, "faults only", el("input", { type: "checkbox", name: "faults", value: "1", checked: q.get("faults") === "1" })),
    el("button", { type: "submit" }, "search"));
  const out = el("div", { id: "results" });
  main.replaceChildren(el("h1", {}, "search ", el("a", { href: runUrl(run), text: run })), form, out);
  if (![...q.keys()].some((k) => ["where", "text", "score", "faults"].includes(k))) return;
  out.append(el("p", { class: "muted", text: "searching…" }));
  try {
    const r = await get(`/api/run/${enc(run)}/search?${q.toString()}`);
    out.replaceChildren();
    if (r.steps) {
      out.append(el("h2", { text: `${r.steps.length} step(s) match ${r.where}` + (r.steps.length ? `; first: ${r.steps[0].step}` : "") }),
        el("table", { class: "grid", id: "step-matches" }, r.steps.map((m) => el("tr", {}, el("td", {}, el("a", { href: stepUrl(run, m.step), text: `step ${m.step}` })),
          Object.entries(m).filter(([k]) => k !== "step").map(([k, v]) => el("td", { text: `${k} = ${fmt(v)}` }))))));
    }
    if (r.samples) {
      out.append(el("h2", { text: `${r.samples.length}${r.truncated ? "+" : ""} sample(s) match` }),
        el("table", { class: "grid", id: "sample-matches" }, el("tr", {}, ["step", "sample", "group", "prompt", "response", "score", "fault"].map((h) => el("th", { text: h }))),
          r.samples.map((s) => el("tr", {}, el("td", {}, el("a", { href: stepUrl(run, s.step), text: `step ${s.step}` })),
            el("td", {}, el("a", { href: `${stepUrl(run, s.step)}#sample-${s.id}`, text: String(s.id) })), el("td", { text: s.group }),
            el("td", { class: "mono", text: s.prompt }), el("td", { class: "mono", text: s.response }), el("td", { text: fmt(s.score) }), el("td", { text: s.env_reason || "" })))));
    }
  } catch (e) {
    fail(out, e);
  }
}

// -----------------------------------------------------------------------------

navigation();
const pages = { run: () => runPage(BOOT.run), step: () => stepPage(BOOT.run, BOOT.step), compare: () => comparePage(BOOT.a, BOOT.b), search: () => searchPage(BOOT.run) };
pages[BOOT.page]().catch((e) => fail(main, e));
