"""Draws what bounds each speed step: for every run of the benchmark's flags
suite (speed 3 with one knob at a time, all of them, speed 4), its samples/s
beside its ceiling (the model's step alone, on a batch already on the device)
and its loader alone (the script's own training loader, no model). The lower
of the two is what the run waits for: its bound, named on the right.

    python part4_torchrun/speed/figures/draw_speed.py

runs `python part4_torchrun/tools/benchmark.py --suites flags --out
part4_torchrun/tools/benchmark_cpu` (minutes: 17 launches on a CPU), then
draws its results.csv. --from CSV [CSV ...] draws saved results instead, one
panel each (a CPU's, a GPU's); --out FILE: the PNG.
"""

import argparse
import csv
import io
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
RESULTS = "part4_torchrun/tools/benchmark_cpu"
# Okabe-Ito
MODEL, LOADER, RUN = "#0072B2", "#E69F00", "#000000"
ROW_IN = 0.38  # inches per run
# what each run row plots: its key, marker, colour, size and name
MARKERS = [
    ("ceiling", "D", MODEL, 9, "model step alone (ceiling)"),
    ("loader", "s", LOADER, 9, "loader alone"),
    ("samples_per_s", "o", RUN, 7, "the run"),
]


def number(text: str) -> float | None:
    return float(text) if text else None


def parse(text: str) -> dict:
    """The runs of a benchmark's results.csv that have a ceiling or a
    loader alone: label, samples/s, ceiling, loader alone, bound (model or
    loader: the slower of the two alone, as the benchmark judged it); and
    what the panel's title says of the machine and the workload."""
    rows = list(csv.DictReader(io.StringIO(text)))
    runs = [
        {
            "label": row["label"],
            "samples_per_s": number(row["samples_per_s"]),
            "ceiling": number(row["ceiling_samples_per_s"]),
            "loader": number(row["loader_samples_per_s"]),
            "bound": row["bound_by"],
        }
        for row in rows
        if row["ceiling_samples_per_s"] or row["loader_samples_per_s"]
    ]
    if not runs:
        raise ValueError("no run with a ceiling or a loader alone in this CSV")
    first = next(row for row in rows if row["label"] == runs[0]["label"])
    gpu = any(row["gpu_util_pct"] for row in rows)
    title = (
        f"{'GPU' if gpu else 'CPU, no GPU'}: {first['workload']},"
        f" {first['batch_per_process']} images a batch,"
        f" {first['world_size']} process"
    )
    return {"title": title, "runs": runs}


def draw_panel(axes, panel: dict) -> None:
    runs = panel["runs"]
    side = axes.get_yaxis_transform()  # x in axes fractions, y in data
    for y, run in enumerate(runs):
        known = [run[key] for key, *_ in MARKERS if run[key]]
        axes.plot([min(known), max(known)], [y, y], color="#CCCCCC", zorder=1)
        for key, marker, color, size, label in MARKERS:
            if run[key]:
                axes.plot(
                    run[key], y, marker, color=color, ms=size, label=label
                )
        if run["samples_per_s"]:
            # the run's own number, left of its leftmost marker
            axes.text(
                min(known) / 1.25,
                y,
                f"{run['samples_per_s']:,.0f}",
                fontsize=11,
                ha="right",
                va="center",
            )
        color = {"model": MODEL, "loader": LOADER}.get(run["bound"], RUN)
        axes.text(
            1.01,
            y,
            run["bound"] or "?",
            color=color,
            fontsize=12,
            va="center",
            transform=side,
        )
    axes.text(1.01, -0.9, "bound", fontsize=12, va="center", transform=side)
    labels = [run["label"] for run in runs]
    axes.set_yticks(range(len(runs)), labels, fontsize=12)
    axes.set_ylim(len(runs) - 0.5, -1.3)
    axes.set_xscale("log")
    # room for the leftmost number
    lowest = min(run[key] for run in runs for key, *_ in MARKERS if run[key])
    axes.set_xlim(left=lowest / 5)
    axes.set_xlabel("samples/s (log scale)", fontsize=12)
    axes.tick_params(axis="x", labelsize=12)
    axes.set_title(panel["title"], loc="left", fontsize=12)
    axes.spines[["top", "right"]].set_visible(False)
    # one entry per marker, above the runs, no box
    handles, names = axes.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    axes.legend(
        unique.values(),
        unique.keys(),
        loc="upper center",
        ncol=3,
        frameon=False,
        fontsize=11,
        columnspacing=1.2,
    )


def draw(panels: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [len(panel["runs"]) + 2.5 for panel in panels]
    fig, rows = plt.subplots(
        len(panels),
        1,
        squeeze=False,
        height_ratios=heights,
        figsize=(9, ROW_IN * sum(heights) + 0.3),
    )
    for axes, panel in zip(rows[:, 0], panels, strict=True):
        draw_panel(axes, panel)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def run_benchmark() -> str:
    """The flags suite on this machine; its results.csv's text."""
    command = [
        sys.executable,
        "part4_torchrun/tools/benchmark.py",
        "--suites",
        "flags",
        "--out",
        RESULTS,
    ]
    # each launch has its own timeout; this bounds the whole
    done = subprocess.run(command, cwd=REPO, timeout=4 * 3600)
    if done.returncode != 0:
        sys.exit(f"error: the benchmark failed: {' '.join(command)}")
    return (REPO / RESULTS / "results.csv").read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        help="results.csv files, one panel each",
    )
    parser.add_argument("--out", default=str(HERE / "speed.png"))
    args = parser.parse_args()
    if args.sources:
        texts = [Path(source).read_text() for source in args.sources]
    else:
        texts = [run_benchmark()]
    draw([parse(text) for text in texts], args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
