"""The run's learning summary: held-out compliance and reply quality (good replies, the base model's NLL per
token) of the base model and after each adapter, as text, JSON (`<run dir>/summary.json`) and a PNG curve
(`<run dir>/compliance.png`).

Many agents (docs/agents.md): records carry `agent_id`; each agent gets its own table, its own entry under
`summary["agents"]` and its own panel in the plot. The top-level figures stay the default agent's."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from metaclaw.store import SampleStore

log = logging.getLogger(__name__)

QUALITY_KEYS = ("good", "nll", "nll_threshold", "fluent", "junk", "distinct_2")


def plot_curve(points: list[dict[str, Any]] | dict[str, list[dict[str, Any]]], path: Path, title: str) -> Path:
    """Compliance and good replies (%) against the adapter's optimizer step (the base model is step 0); the
    base model's NLL per token of the replies on a second axis. `{agent: points}`: one panel per agent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = points if isinstance(points, dict) else {"": points}
    fig, axes = plt.subplots(len(curves), 1, figsize=(6.4, 3.8 * len(curves)), dpi=110, squeeze=False)
    for ax, (agent, pts) in zip(axes[:, 0], curves.items(), strict=True):
        _draw(ax, pts, f"agent {agent}: {title}" if agent else title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _draw(ax: Any, points: list[dict[str, Any]], title: str) -> None:
    """One panel: compliance, good replies and the replies' base NLL of one agent's evaluations."""
    xs = [p["step"] for p in points]
    ax.plot(xs, [100 * p["compliance"] for p in points], marker="o", label="complies")
    band = [
        (x, 100 * p["ci_low"], 100 * p["ci_high"])
        for x, p in zip(xs, points, strict=True)
        if p.get("ci_low") is not None
    ]
    if band:
        bx, lo, hi = zip(*band, strict=True)
        ax.fill_between(bx, lo, hi, alpha=0.15, color="tab:blue", label="complies: 95% interval")
    good = [(x, 100 * p["good"]) for x, p in zip(xs, points, strict=True) if p.get("good") is not None]
    if good:
        ax.plot(*zip(*good, strict=True), marker="s", color="tab:green", label="good (complies and fluent)")
    ax.set_xlabel("optimizer step of the adapter")
    ax.set_ylabel("held-out replies (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    nll = [(x, p["nll"]) for x, p in zip(xs, points, strict=True) if p.get("nll") is not None]
    if nll:
        ax2 = ax.twinx()
        ax2.plot(*zip(*nll, strict=True), marker="^", color="tab:red", linestyle=":", label="base NLL/token")
        threshold = next((p["nll_threshold"] for p in points if p.get("nll_threshold") is not None), None)
        if threshold is not None:
            ax2.axhline(threshold, color="tab:red", linewidth=0.8, alpha=0.5, label="fluent below (base + margin)")
        ax2.set_ylim(0, 1.25 * max([y for _, y in nll] + [threshold or 0.0]))  # from 0: a small rise looks small
        ax2.set_ylabel("base model's NLL per token (nats)")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="best", fontsize=7)


def _curve(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One agent's curve and its base and final figures."""
    keys = ("step", "adapter", "compliance", "ci_low", "ci_high", "n", *QUALITY_KEYS)
    points = sorted(({k: r.get(k) for k in keys} for r in results), key=lambda p: p["step"])
    base = next((p for p in points if p["adapter"] == "base"), None)
    final = points[-1] if points and points[-1]["adapter"] != "base" else None
    out: dict[str, Any] = {"curve": points}
    for key in ("compliance", "good", "nll"):
        out[f"base_{key}"], out[f"final_{key}"] = base and base[key], final and final[key]
    return out


def write_report(
    run_dir: str | Path,
    results: list[dict[str, Any]],
    store: SampleStore,
    steps: int,
    wall_s: float,
    user_stats: dict[str, Any] | None = None,
    title: str = "held-out replies: compliance and quality",
    unfinished: list[dict[str, Any]] | None = None,
    ended_early: str | None = None,
) -> dict[str, Any]:
    """Summary dict (`text` holds the printout); writes summary.json and compliance.png into `run_dir`.

    `unfinished` names the evaluations the end of training stopped waiting for (`LiveEvaluator.unfinished`): the
    summary says they are missing rather than pass the last finished one off as the final figure. `ended_early`:
    why the sample stream ended the run before its time or step budget (e.g. no samples came for
    `rollout.wait_timeout_s`: the agent or the policy server stalled)."""
    run_dir = Path(run_dir)
    by_agent: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_agent.setdefault(r.get("agent_id") or "default", []).append(r)
    curves = {agent: _curve(rs) for agent, rs in sorted(by_agent.items(), key=lambda kv: kv[0] != "default")}
    main = curves.get("default") or next(iter(curves.values()), _curve([]))
    counts = store.counts()
    trained = counts.get("consumed", 0)
    summary: dict[str, Any] = {
        **main,
        "steps": steps,
        "samples_trained": trained,
        "store": counts,
        "wall_s": round(wall_s, 1),
        "user": user_stats or {},
        "unfinished_evaluations": list(unfinished or []),
        "ended_early": ended_early,
    }
    several = len(curves) > 1 or bool(curves and "default" not in curves)
    if several:
        summary["agents"] = curves
    judged = any(r.get("reward") is not None for r in results)  # the judge fallback: served versions' turns
    lines = _table(curves, several, judged) + _not_measured(unfinished or [])
    lines.append(f"samples trained: {trained}   optimizer steps: {steps}   wall time: {wall_s / 60:.1f} min")
    if ended_early:
        lines.append(f"the run ended early, at step {steps}: {ended_early}")
    if user_stats:
        lines.append(
            f"simulated user: {user_stats.get('sessions', 0)} sessions, {user_stats.get('replies', 0)} replies, "
            f"{user_stats.get('complied', 0)} thanked, {user_stats.get('corrected', 0)} corrected"
        )
        for agent, u in (user_stats.get("agents") or {}).items():
            lines.append(f"  as {agent}: {u.get('replies', 0)} replies, {u.get('complied', 0)} thanked")
    if curves:
        plotted = {a: c["curve"] for a, c in curves.items()} if several else main["curve"]
        try:
            summary["plot"] = str(plot_curve(plotted, run_dir / "compliance.png", title))
        except ModuleNotFoundError as e:  # matplotlib is the plots extra
            log.warning("compliance.png not drawn (%s): pip install 'metaclaw[plots]'", e)
            summary["plot"] = None
        drawn = summary["plot"] or "not drawn (pip install 'metaclaw[plots]')"
        lines.append(f"curve: {drawn}   log: {run_dir / 'eval.jsonl'}")
    summary["text"] = "\n".join(lines)
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "text"}, indent=1))
    return summary


def _table(curves: dict[str, dict[str, Any]], several: bool, judged: bool) -> list[str]:
    """The printout's table: one row per evaluated adapter (per agent when `several`)."""
    what = (
        "held-out turns per served version: complies = the judge scored the turn > 0"
        if judged
        else "held-out replies: complies = follows the user's hidden preference"
    )
    lines = [
        "",
        "=== metaclaw: what the agent learned ===",
        f"{what}; good = complies and fluent (the",
        "base model's NLL/token of the reply within the margin of its own); junk = empty or repetitive",
        f"  {'':<22} {'complies':>8} {'95% CI':>9} {'good':>6} {'NLL':>6} {'junk':>5}",
    ]
    for agent, curve in curves.items():
        if several:
            lines.append(f" agent {agent}:")
        for p in curve["curve"]:
            label = "base model" if p["adapter"] == "base" else f"adapter {p['adapter']}"
            if judged and p["adapter"] != "base":
                label = f"served {p['adapter']}"
            good = "-" if p.get("good") is None else f"{100 * p['good']:.0f}%"
            nll = "-" if p.get("nll") is None else f"{p['nll']:.2f}"
            junk = "-" if p.get("junk") is None else f"{100 * p['junk']:.0f}%"
            ci = "-" if p.get("ci_low") is None else f"{100 * p['ci_low']:.0f}-{100 * p['ci_high']:.0f}%"
            lines.append(
                f"  {label:<22} {100 * p['compliance']:7.1f}% {ci:>9} {good:>6} {nll:>6} {junk:>5}  ({p['n']} replies)"
            )
    if not curves:
        lines.append("  (no evaluation finished)")
    return lines


def _not_measured(unfinished: list[dict[str, Any]]) -> list[str]:
    """A line per evaluation the end of training stopped waiting for."""
    lines = []
    for u in unfinished:
        what = "the served versions' turns" if u.get("step") is None else f"step {u['step']}"
        lines.append(f"  not measured: {what} of agent {u.get('agent_id')} (still running when the end of training"
                     " stopped waiting: raise eval.final_timeout_s)")  # fmt: skip
    return lines
