// metaclaw dashboard: plain JS, no build step, no external requests. The key lives in sessionStorage and goes
// in the Authorization header only. Every value from the server is set with textContent (never parsed as HTML).
"use strict";
(function () {
  const KEY = "metaclaw-dashboard-key";
  const POLL_MS = 2000;
  const $ = (id) => document.getElementById(id);
  let live = false;
  let timer = null;
  let keyRequired = null;  // GET /dashboard/api/auth: a finished run's page on loopback needs no key

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else if (k === "onclick") node.addEventListener("click", v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }
  const pct = (x) => (x == null ? "-" : Math.round(100 * x) + "%");
  const num = (x, d = 2) => (x == null ? "-" : Number(x).toFixed(d));
  const age = (s) => (s == null ? "-" : s < 120 ? Math.round(s) + " s" : (s / 60).toFixed(1) + " min");
  function say(text, error) { $("message").textContent = text || ""; $("message").className = error ? "error" : ""; }

  function key() { return sessionStorage.getItem(KEY); }
  function headers(json) {
    const h = key() ? { Authorization: "Bearer " + key() } : {};  // a finished run's page on loopback needs none
    if (json) h["Content-Type"] = "application/json";
    return h;
  }
  function askKey() {
    $("key-form").hidden = false; $("main").hidden = true;
    if (timer) { clearTimeout(timer); timer = null; }
  }

  async function post(path, body, extra) {
    const r = await fetch(path, { method: "POST", headers: { ...headers(true), ...(extra || {}) },
                                  body: JSON.stringify(body || {}), credentials: "omit", cache: "no-store" });
    let data = {};
    try { data = await r.json(); } catch (e) { data = {}; }
    if (r.status === 401) { sessionStorage.removeItem(KEY); askKey(); }
    if (!r.ok) throw new Error((data.error && data.error.message) || ("HTTP " + r.status));
    return data;
  }
  async function act(label, path, body, extra) {
    say(label + "...");
    try { const d = await post(path, body, extra); say(d.message || label + ": done"); refresh(); }
    catch (e) { say(label + " failed: " + e.message, true); }
  }

  function chart(agent, points) {
    const W = 520, H = 200, L = 36, R = 10, T = 10, B = 26;
    const box = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, id: "curve-" + agent, role: "img" });
    const steps = points.map((p) => p.step);
    const lo = Math.min(0, ...steps), hi = Math.max(1, ...steps);
    const x = (s) => L + ((s - lo) / (hi - lo || 1)) * (W - L - R);
    const y = (v) => T + (1 - v) * (H - T - B);
    for (const v of [0, 0.5, 1]) {
      box.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "axis" }));
      const t = svg("text", { x: 4, y: y(v) + 3, class: "tick" }); t.textContent = pct(v); box.append(t);
    }
    const t = svg("text", { x: W - R - 40, y: H - 6, class: "tick" }); t.textContent = "step " + hi; box.append(t);
    const t0 = svg("text", { x: L, y: H - 6, class: "tick" }); t0.textContent = "step " + lo; box.append(t0);
    box.append(svg("polyline", { class: "line", points: points.map((p) => `${x(p.step)},${y(p.compliance)}`).join(" ") }));
    for (const p of points) {
      box.append(svg("line", { x1: x(p.step), x2: x(p.step), y1: y(p.ci_low), y2: y(p.ci_high), class: "ci" }));
      const c = svg("circle", { cx: x(p.step), cy: y(p.compliance), r: 4,
                                class: "point" + (p.gate === "rejected" ? " rejected" : "") });
      const tip = svg("title");
      tip.textContent = `${p.adapter} (step ${p.step}): ${pct(p.compliance)} [${pct(p.ci_low)}, ${pct(p.ci_high)}], n=${p.n}` +
        (p.gate ? `, gate ${p.gate}` : "");
      c.append(tip); box.append(c);
    }
    return el("div", { class: "chart" }, el("div", {}, agent === "default" ? "default agent" : "agent " + agent), box);
  }

  // The training curves over steps (state.training.series: [[step, value], ...]); gate decisions as marks.
  const SERIES = [["loss", "loss"], ["reward", "reward (mean)"], ["samples_per_min", "samples trained / min"],
    ["replies_per_min", "replies / min"], ["sample_age_s", "sample age (s)"], ["trainer_lag", "trainer lag (versions)"],
    ["lr", "learning rate"], ["grad_norm", "gradient norm"], ["ratio_mean", "importance ratio (mean)"],
    ["ratio_min", "importance ratio (min)"], ["ratio_max", "importance ratio (max)"],
    ["clip_frac", "tokens clipped (share)"], ["ratio_truncated_frac", "tokens truncated (share)"]];
  function spark(name, title, points, marks) {
    const W = 250, H = 110, L = 44, R = 6, T = 16, B = 16;
    const box = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, id: "series-" + name, role: "img" });
    const head = svg("text", { x: 4, y: 11, class: "tick" }); head.textContent = title; box.append(head);
    const steps = points.map((p) => p[0]).concat(marks.map((m) => m[0])), vals = points.map((p) => p[1]);
    const s0 = Math.min(...steps), s1 = Math.max(...steps), v0 = Math.min(...vals), v1 = Math.max(...vals);
    const x = (s) => L + ((s - s0) / (s1 - s0 || 1)) * (W - L - R);
    const y = (v) => T + (1 - (v - v0) / (v1 - v0 || 1)) * (H - T - B);
    for (const v of [v0, v1]) {
      const t = svg("text", { x: 2, y: y(v) + 3, class: "tick" }); t.textContent = Number(v.toPrecision(3)); box.append(t);
    }
    const foot = svg("text", { x: L, y: H - 3, class: "tick" }); foot.textContent = `steps ${s0}-${s1}`; box.append(foot);
    box.append(svg("polyline", { class: "line", points: points.map((p) => `${x(p[0])},${y(p[1])}`).join(" ") }));
    for (const [s, decision] of marks) {
      const m = svg("line", { x1: x(s), x2: x(s), y1: T, y2: H - B, class: "gate-mark " + decision });
      const tip = svg("title"); tip.textContent = `gate at step ${s}: ${decision}`; m.append(tip); box.append(m);
    }
    return el("div", { class: "chart small" }, box);
  }
  function renderTraining(training, gate) {
    const root = $("series"); root.replaceChildren();
    const series = (training && training.series) || {};
    const marks = (gate || []).filter((g) => g.step != null).map((g) => [g.step, g.decision]);
    for (const [name, title] of SERIES) if (series[name] && series[name].length) root.append(spark(name, title, series[name], marks));
    const mix = (training && training.reward_mix) || [];
    if (mix.length) {
      const share = (k) => mix.map((m) => [m.step, m[k] / Math.max(1, m.positive + m.negative + m.zero)]);
      root.append(spark("reward_positive", "reward mix: share +", share("positive"), marks),
                  spark("reward_negative", "reward mix: share \u2212", share("negative"), marks));
    }
    if (!root.children.length) root.append(el("p", { class: "muted" }, "no training steps logged yet (csv/metrics.csv)"));
  }

  function renderCurves(curves) {
    const root = $("curves"); root.replaceChildren();
    const agents = Object.keys(curves);
    if (!agents.length) root.append(el("p", { class: "muted" }, "no evaluation yet (eval.jsonl is empty)"));
    for (const a of agents) root.append(chart(a, curves[a]));
    const q = $("quality"); q.replaceChildren(el("tr", {}, el("th", {}, "agent"), el("th", {}, "adapter"),
      el("th", {}, "compliance"), el("th", {}, "good replies"), el("th", {}, "fluent"), el("th", {}, "base NLL")));
    for (const a of agents) {
      const p = curves[a][curves[a].length - 1];
      q.append(el("tr", {}, el("td", {}, a), el("td", {}, p.adapter), el("td", {}, pct(p.compliance)),
        el("td", {}, pct(p.good)), el("td", {}, pct(p.fluent)), el("td", {}, num(p.nll))));
    }
  }

  function renderSamples(s) {
    const t = $("samples"); t.replaceChildren();
    if (!s) { t.append(el("tr", {}, el("td", {}, "no sample store"))); return; }
    const rows = [["captured", s.captured], ["scored", s.scored], ["trained", s.trained], ["backlog (ready)", s.backlog],
      ["oldest waiting", age(s.oldest_waiting_s)], ["median age when trained", age(s.median_trained_age_s)]];
    for (const [reason, n] of Object.entries(s.dropped || {})) rows.push(["dropped: " + reason, n]);
    for (const [k, v] of rows) t.append(el("tr", {}, el("th", {}, k), el("td", {}, v)));
  }

  function renderWindow(w, state) {
    const root = $("window"); root.replaceChildren();
    if (!w) { root.append(el("p", { class: "muted" }, "finished run (read from its directory)")); return; }
    root.append(el("p", {}, el("b", { class: w.open ? "accepted" : "held" }, w.open ? "OPEN" : "closed"),
      " ", (w.reasons || []).join("; ")));
    if (w.paused) root.append(el("p", { class: "held" }, "paused"));
    if (w.next_window) root.append(el("p", {}, "next: " + w.next_window.start + " (" + w.next_window.reason + ")"));
    if (state.steps_done != null) root.append(el("p", {}, "steps done: " + state.steps_done));
    if (state.rollback_step != null) root.append(el("p", {}, "rolled back to step " + state.rollback_step));
  }

  function renderAdapters(adapters) {
    const root = $("adapters"); root.replaceChildren();
    for (const [agent, info] of Object.entries(adapters)) {
      const served = info.served || {};
      const name = served.path ? served.path.split("/").pop() : "base model";
      root.append(el("p", {}, (agent === "default" ? "default agent" : "agent " + agent) + ": serving ",
        el("b", { id: "served-" + agent, class: "served" }, name), el("span", { class: "muted" }, " [" + (served.source || "") + "]")));
      const t = el("table", {}, el("tr", {}, el("th", {}, "adapter"), el("th", {}, "gate"), el("th", {}, "candidate"),
        el("th", {}, "served then"), el("th", {}, "why"), el("th", {}, "")));
      for (const a of info.adapters.slice().reverse().slice(0, 30)) {
        const btn = live ? el("button", { type: "button", class: "rollback", "data-step": a.step, "data-agent": agent,
          onclick: () => act("roll back to step " + a.step, "/control/rollback",
                             agent === "default" ? { step: a.step } : { step: a.step, agent: agent }) }, "serve this") : "";
        t.append(el("tr", {}, el("td", { class: a.served ? "served" : "" }, a.name + (a.served ? " (served)" : "")),
          el("td", { class: a.gate || "" }, a.gate || "-"), el("td", {}, pct(a.candidate)), el("td", {}, pct(a.served_score)),
          el("td", { class: "muted" }, (a.reasons || []).join("; ")), el("td", {}, btn)));
      }
      root.append(t);
    }
  }

  function renderGate(gate) {
    const t = $("gate"); t.replaceChildren(el("tr", {}, el("th", {}, "time"), el("th", {}, "agent"), el("th", {}, "what"),
      el("th", {}, "decision"), el("th", {}, "evidence")));
    for (const g of gate.slice().reverse().slice(0, 12)) {
      let what = g.adapter || "", ev = "";
      if (g.kind === "regression") {
        what = "served v" + g.served.version;
        ev = `good ${pct(g.served.share)} (n=${g.served.n}) vs previous ${pct(g.previous.share)} (n=${g.previous.n}), p=${num(g.p_value, 3)}`;
      } else if (g.candidate != null) {
        const ci = g.candidate_ci ? ` [${pct(g.candidate_ci[0])}, ${pct(g.candidate_ci[1])}]` : "";
        ev = `candidate ${pct(g.candidate)}${ci} vs served ${pct(g.served)}, n=${g.n}` +
          (g.candidate_nll != null ? `, NLL ${num(g.candidate_nll)} vs ${num(g.base_nll)}` : "");
      } else if (g.reasons) ev = g.reasons.join("; ");
      t.append(el("tr", {}, el("td", {}, new Date(1000 * g.time).toLocaleTimeString()), el("td", {}, g.agent_id),
        el("td", {}, what), el("td", { class: g.decision }, g.decision), el("td", { class: "muted" }, ev)));
    }
  }

  function renderSessions(sessions, showText) {
    const root = $("sessions"); root.replaceChildren();
    if (!sessions.length) root.append(el("p", { class: "muted" }, "no turns captured yet"));
    for (const s of sessions) {
      const line = el("div", { class: "session" }, el("b", {}, s.agent_id + " / " + s.session_id + ": "));
      for (const t of s.turns) {
        const cls = t.reward == null ? "zero" : t.reward > 0 ? "pos" : t.reward < 0 ? "neg" : "zero";
        const label = `#${t.turn_index} ${t.reward == null ? "unscored" : (t.reward > 0 ? "+" : "") + num(t.reward, 1)}` +
          ` ${t.source || ""}${t.dropped ? " (" + t.dropped + ")" : ""} v${t.adapter_version}`;
        const chip = el("span", { class: "turn " + cls, "data-session": s.session_id, "data-turn": t.turn_index }, label);
        if (live) {
          const send = (score) => act(score > 0 ? "thumbs up" : "thumbs down", "/v1/feedback",
            { score: score, session_id: s.session_id, turn_index: t.turn_index }, { "X-Agent-Id": s.agent_id });
          chip.append(el("button", { type: "button", class: "thumb-up", title: "thumbs up: a good reply", onclick: () => send(1) }, "+1"),
                      el("button", { type: "button", class: "thumb-down", title: "thumbs down: a bad reply", onclick: () => send(-1) }, "\u22121"));
        }
        line.append(chip);
        if (showText && t.reply != null) line.append(el("div", { class: "text" }, "user: " + t.user + "\nreply: " + t.reply + "\nreaction: " + t.reaction));
      }
      if (!showText) line.append(el("div", { class: "text muted placeholder" }, "turn text hidden: privacy.show_text " +
        "is off (" + (live ? "privacy.show_text=true on the service" : "--show-text") + " shows it)"));
      root.append(line);
    }
  }

  function renderSkills(skills) {
    const root = $("skills"); root.replaceChildren();
    const agents = Object.keys(skills);
    if (!agents.length) root.append(el("p", { class: "muted" }, "skills off (or none yet)"));
    for (const a of agents) {
      const s = skills[a];
      root.append(el("p", {}, el("b", {}, a), ` generation ${s.generation}: ` + (s.skills.join(", ") || "none")));
      for (const h of s.history) root.append(el("div", { class: "muted" }, `${new Date(1000 * h.ts).toLocaleString()} ${h.action || ""} ${h.name || ""} ${h.reason || ""}`));
    }
  }

  function render(state) {
    live = state.live;
    $("mode").textContent = live ? "live" : "finished run";
    $("mode").className = "badge" + (live ? " live" : "");
    $("run-dir").textContent = state.run_dir;
    $("updated").textContent = "updated " + new Date(1000 * state.time).toLocaleTimeString();
    $("actions").hidden = !live;
    renderCurves(state.curves); renderSamples(state.samples); renderWindow(state.window, state);
    renderAdapters(state.adapters); renderGate(state.gate); renderSessions(state.sessions, state.show_text);
    renderSkills(state.skills); renderTraining(state.training, state.gate);
  }

  async function refresh() {
    if (timer) { clearTimeout(timer); timer = null; }
    try {
      if (!key() && keyRequired === null) {
        const a = await fetch("/dashboard/api/auth", { credentials: "omit", cache: "no-store" });
        keyRequired = !a.ok || (await a.json()).key_required !== false;
      }
      if (!key() && keyRequired) { askKey(); return; }
      const r = await fetch("/dashboard/api/state", { headers: headers(false), credentials: "omit", cache: "no-store" });
      if (r.status === 401) {
        if (key()) say("wrong key", true);
        sessionStorage.removeItem(KEY); askKey(); return;
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      $("key-form").hidden = true; $("main").hidden = false;
      if ($("message").className === "error" && $("message").textContent.startsWith("cannot reach")) say("");
    } catch (e) { say("cannot reach the service: " + e.message, true); }
    timer = setTimeout(refresh, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault(); sessionStorage.setItem(KEY, $("key").value); $("key").value = ""; refresh();
    });
    $("pause").addEventListener("click", () => act("pause", "/control/pause"));
    $("resume").addEventListener("click", () => act("resume", "/control/resume"));
    $("train-now").addEventListener("click", () => act("train now", "/control/train-now"));
    refresh();
  });
})();
