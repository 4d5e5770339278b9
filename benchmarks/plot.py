"""Charts of the benchmark results, for the docs.

Reads benchmarks/results/overhead.json (benchmarks/overhead.py), scaling.json (samples/s per
strategy and process count, when present) and peers.json (benchmarks/peers.py); writes
docs/img/overhead.png (step-time ratios against the hand-written loops) and
docs/img/throughput.png (samples per second). A missing input leaves its panel out.

    python benchmarks/plot.py
    python benchmarks/plot.py --results benchmarks/results --out docs/img

Needs matplotlib (``pip install matplotlib``), in the benchmark environment only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS_ORDER = ("hand", "distkit", "runtime", "fabric", "lightning", "accelerate")
PEER_LABELS = {
    "hand": "hand loop",
    "distkit": "distkit",
    "runtime": "distkit\nRuntime",
    "fabric": "Lightning\nFabric",
    "lightning": "Lightning\nTrainer",
    "accelerate": "Accelerate",
}
COLORS = ["#4C72B0", "#DD8452", "#937860", "#55A868", "#C44E52", "#8172B3"]


def load(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path} is not valid JSON ({exc}); rerun the benchmark") from exc


def subtitle(peers: Any, sources: list[Path]) -> str:
    """'<machine>, <date>': from peers.json's meta, else this machine and the files' date."""
    meta = (peers or {}).get("meta", {})
    machine = meta.get("machine") or f"{os.cpu_count()}-core CPU machine"
    if meta.get("date"):
        date = str(meta["date"])[:10]
    else:
        stamps = [p.stat().st_mtime for p in sources if p.is_file()]
        day = _dt.date.fromtimestamp(max(stamps)) if stamps else _dt.date.today()
        date = day.isoformat()
    return f"{machine}, {date}"


def peer_rows(peers: Any) -> list[tuple[int, dict[str, Any]]]:
    """``[(processes, {framework: entry})]`` from peers.json, fewest processes first."""
    rows = []
    for block in (peers or {}).values():
        if isinstance(block, dict) and "frameworks" in block:
            rows.append((int(block.get("processes", 1)), block["frameworks"]))
    return sorted(rows, key=lambda row: row[0])


def grouped_bars(ax, groups, series, value, label_of, fmt, spread=None) -> None:  # type: ignore[no-untyped-def]
    """Bars for ``groups`` (x) x ``series`` (colours); ``value(group, serie)`` or None.

    ``spread(group, serie)`` -> ``(low, high)`` or None draws a range line over the bar.
    """
    width = 0.8 / max(len(series), 1)
    top = 0.0
    for i, serie in enumerate(series):
        label: str | None = label_of(serie)  # on the first bar of the series only
        for j, group in enumerate(groups):
            x = j + (i - (len(series) - 1) / 2) * width
            v = value(group, serie)
            if v is None:  # failed or not installed
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8, color="0.4")
                continue
            top = max(top, v)
            ax.bar(x, v, width * 0.92, color=COLORS[i % len(COLORS)], label=label)
            label = None
            low_high = spread(group, serie) if spread else None
            if low_high:
                low, high = low_high
                ax.vlines(x, low, high, color="0.15", linewidth=1.2)
                top = max(top, high)
            ax.text(x + width * 0.05, v, fmt(v), ha="left" if low_high else "center",
                    va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(groups)))
    ax.set_ylim(0, top * 1.18 if top else 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=9, loc="upper left")


def plot_overhead(plt, overhead: Any, peers: Any, title: str):  # type: ignore[no-untyped-def]
    panels = [p for p in (overhead, peer_rows(peers)) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.2), squeeze=False)
    axes = list(axes[0])
    if overhead:
        ax = axes.pop(0)
        configs = list(overhead)
        ratios = [overhead[c]["ratio"] for c in configs]
        ax.bar(range(len(configs)), ratios, 0.6, color=COLORS[1])
        for x, c in enumerate(configs):
            r = overhead[c]
            ax.text(
                x,
                max(r["ratio"], 1.03) + 0.02,
                f"{r['ratio']:.3f}\n{r['distkit_ms']:.2f} vs {r['hand_ms']:.2f} ms",
                ha="center",
                va="bottom",
                fontsize=9,
            )
        ax.set_xticks(range(len(configs)), configs)
        ax.set_xlim(-0.7, max(len(configs), 3) - 0.3)
        ax.axhline(1.0, color="0.3", linewidth=1)
        ax.axhline(1.03, color="0.3", linewidth=1, linestyle="--", label="target 1.03")
        ax.set_ylim(0, max([*ratios, 1.03]) * 1.3)
        ax.set_ylabel("distkit step time / hand loop's (lower is better)")
        ax.set_title("distkit vs the hand-written loops (overhead.py)", fontsize=11)
        ax.legend(fontsize=9, loc="lower right")
    rows = peer_rows(peers)
    if rows:
        ax = axes.pop(0)
        frameworks = [f for f in PEERS_ORDER if any(f in fw for _, fw in rows)]
        by_procs = dict(rows)

        def ratio(framework: str, procs: int) -> float | None:
            entry = by_procs[procs].get(framework, {})
            return entry.get("ratio") if entry.get("status") == "ok" else None

        def rounds(framework: str, procs: int) -> tuple[float, float] | None:
            per_round = by_procs[procs].get(framework, {}).get("round_ratios")
            return (min(per_round), max(per_round)) if per_round and framework != "hand" else None

        grouped_bars(
            ax,
            frameworks,
            list(by_procs),
            ratio,
            lambda n: f"{n} process{'es' if n > 1 else ''}",
            lambda v: f"{v:.2f}",
            spread=rounds,
        )
        ax.set_xticklabels([PEER_LABELS.get(f, f) for f in frameworks])
        ax.axhline(1.0, color="0.3", linewidth=1)
        ax.set_ylabel("step time / hand loop's, same processes (lower is better)")
        ax.set_xlabel(
            "bar: median step / hand loop's; line: lowest-highest ratio over the rounds; "
            "n/a: not installed or failed",
            fontsize=8,
            color="0.3",
        )
        ax.set_title("frameworks vs the hand-written loop (peers.py)", fontsize=11)
    fig.suptitle(f"Step-time overhead, median over interleaved rounds - {title}", fontsize=12)
    fig.tight_layout()
    return fig


def plot_throughput(plt, scaling: Any, overhead: Any, peers: Any, title: str):  # type: ignore[no-untyped-def]
    rows = peer_rows(peers)
    panels = [p for p in (scaling, rows) if p]
    if not panels and overhead:
        panels = [overhead]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.2), squeeze=False)
    axes = list(axes[0])
    samples = "samples / s, all processes (higher is better)"
    if scaling:
        ax = axes.pop(0)
        strategies = list(scaling)
        counts = sorted({int(n) for s in strategies for n in scaling[s]})

        def rate(strategy: str, n: int) -> float | None:
            entry = scaling[strategy].get(str(n))
            return float(entry["samples_per_s"]) if entry else None

        grouped_bars(
            ax,
            strategies,
            counts,
            rate,
            lambda n: f"{n} process{'es' if n > 1 else ''}",
            lambda v: f"{v:,.0f}",
        )
        ax.set_xticklabels(strategies)
        ax.set_ylabel(samples)
        ax.set_title("distkit strategies by process count (scaling.json)", fontsize=11)
    if rows:
        ax = axes.pop(0)
        frameworks = [f for f in PEERS_ORDER if any(f in fw for _, fw in rows)]
        by_procs = dict(rows)

        def peer_rate(framework: str, procs: int) -> float | None:
            entry = by_procs[procs].get(framework, {})
            return entry.get("samples_per_s") if entry.get("status") == "ok" else None

        grouped_bars(
            ax,
            frameworks,
            list(by_procs),
            peer_rate,
            lambda n: f"{n} process{'es' if n > 1 else ''}",
            lambda v: f"{v:,.0f}",
        )
        ax.set_xticklabels([PEER_LABELS.get(f, f) for f in frameworks])
        ax.set_ylabel(samples)
        ax.set_xlabel("n/a: not installed or failed (see peers.json)", fontsize=8, color="0.4")
        ax.set_title("same CNN in each framework (peers.py)", fontsize=11)
    if not scaling and not rows and overhead:
        ax = axes.pop(0)
        configs = list(overhead)

        def overhead_rate(config: str, which: str) -> float:
            r = overhead[config]
            return r["world_size"] * r["batch_size_per_process"] / r[f"{which}_ms"] * 1e3

        grouped_bars(
            ax,
            configs,
            ["hand", "distkit"],
            overhead_rate,
            lambda s: "hand loop" if s == "hand" else s,
            lambda v: f"{v:,.0f}",
        )
        ax.set_xticklabels(configs)
        ax.set_ylabel(samples)
        ax.set_title("from median step times (overhead.py)", fontsize=11)
    fig.suptitle(f"Training throughput, small CNN - {title}", fontsize=12)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        type=Path,
        default=ROOT / "benchmarks" / "results",
        help="folder with overhead.json, scaling.json, peers.json",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "img",
        help="folder for overhead.png and throughput.png (default docs/img)",
    )
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    paths = {name: args.results / f"{name}.json" for name in ("overhead", "scaling", "peers")}
    overhead, scaling, peers = (load(paths[n]) for n in ("overhead", "scaling", "peers"))
    for name, data in (("overhead", overhead), ("scaling", scaling), ("peers", peers)):
        if data is None:
            print(f"no {paths[name]}: its panel is left out")
    if not (overhead or scaling or peer_rows(peers)):
        print(
            "nothing to plot: run benchmarks/overhead.py and/or benchmarks/peers.py first",
            file=sys.stderr,
        )
        return 1
    title = subtitle(peers, list(paths.values()))
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if overhead or peer_rows(peers):
        fig = plot_overhead(plt, overhead, peers, title)
        fig.savefig(args.out / "overhead.png", dpi=110)
        plt.close(fig)
        written.append(args.out / "overhead.png")
    fig = plot_throughput(plt, scaling, overhead, peers, title)
    fig.savefig(args.out / "throughput.png", dpi=110)
    plt.close(fig)
    written.append(args.out / "throughput.png")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
