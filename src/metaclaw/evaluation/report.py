"""The run's learning summary: held-out compliance of the base model and after each adapter, as text, JSON
(`<run dir>/summary.json`) and a PNG curve (`<run dir>/compliance.png`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metaclaw.store import SampleStore


def plot_curve(points: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Compliance (%) against the adapter's optimizer step; the base model is step 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    xs = [p["step"] for p in points]
    ys = [100 * p["compliance"] for p in points]
    ax.plot(xs, ys, marker="o")
    if points and points[0]["adapter"] == "base":
        ax.axhline(ys[0], color="grey", linestyle="--", linewidth=1, label="base model")
        ax.legend(loc="lower right")
    ax.set_xlabel("optimizer step of the adapter")
    ax.set_ylabel("held-out compliance (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(
    run_dir: str | Path,
    results: list[dict[str, Any]],
    store: SampleStore,
    steps: int,
    wall_s: float,
    user_stats: dict[str, Any] | None = None,
    title: str = "held-out compliance",
) -> dict[str, Any]:
    """Summary dict (`text` holds the printout); writes summary.json and compliance.png into `run_dir`."""
    run_dir = Path(run_dir)
    points = sorted(
        ({k: r[k] for k in ("step", "adapter", "compliance", "n")} for r in results), key=lambda p: p["step"]
    )
    counts = store.counts()
    trained = counts.get("consumed", 0)
    summary: dict[str, Any] = {
        "curve": points,
        "base_compliance": next((p["compliance"] for p in points if p["adapter"] == "base"), None),
        "final_compliance": points[-1]["compliance"] if points and points[-1]["adapter"] != "base" else None,
        "steps": steps,
        "samples_trained": trained,
        "store": counts,
        "wall_s": round(wall_s, 1),
        "user": user_stats or {},
    }
    lines = ["", "=== metaclaw: what the agent learned ===", "held-out compliance (the user's hidden preference):"]
    for p in points:
        label = "base model" if p["adapter"] == "base" else f"adapter {p['adapter']}"
        lines.append(f"  {label:<22} {100 * p['compliance']:5.1f}%  ({p['n']} replies)")
    if not points:
        lines.append("  (no evaluation finished)")
    lines.append(f"samples trained: {trained}   optimizer steps: {steps}   wall time: {wall_s / 60:.1f} min")
    if user_stats:
        lines.append(
            f"simulated user: {user_stats.get('sessions', 0)} sessions, {user_stats.get('replies', 0)} replies, "
            f"{user_stats.get('complied', 0)} thanked, {user_stats.get('corrected', 0)} corrected"
        )
    if points:
        summary["plot"] = str(plot_curve(points, run_dir / "compliance.png", title))
        lines.append(f"curve: {summary['plot']}   log: {run_dir / 'eval.jsonl'}")
    summary["text"] = "\n".join(lines)
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "text"}, indent=1))
    return summary
