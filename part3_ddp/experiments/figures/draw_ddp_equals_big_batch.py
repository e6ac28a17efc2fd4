"""Draw how far N ranks x batch B land from one process x batch N*B, step by
step, with DDP and with the mistakes that break it, from the `compare` lines of
ddp_equals_big_batch.py.

A column per run, a dot per SGD step (left to right): the largest difference
between rank 0's weights and the one process's after that step, on a log
scale. Blue: DDP as the course uses it; vermillion: a planted mistake or
BatchNorm.

    python part3_ddp/experiments/figures/draw_ddp_equals_big_batch.py
        runs python part3_ddp/experiments/ddp_equals_big_batch.py, draws
        ddp_equals_big_batch.png
    python part3_ddp/experiments/figures/draw_ddp_equals_big_batch.py \\
        --from out.txt
        draws from a saved output of ddp_equals_big_batch.py
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "ddp_equals_big_batch.py"
PAIR = re.compile(r"(\w+)=(\S+)")
RIGHT, WRONG = "#0072B2", "#D55E00"
NAMES = {
    ("ddp", "mlp"): "DDP",
    ("no_sampler", "mlp"): "no sampler",
    ("no_wrap", "mlp"): "no wrap",
    ("ddp", "mlp_batchnorm"): "DDP with\nBatchNorm",
}


def parse(text: str) -> list[dict]:
    """One dict per compare line, in order: setup, model, dtype, ranks,
    batch, big_batch, replicas_equal, diffs (one per step)."""
    runs = []
    for line in text.splitlines():
        if not line.startswith("compare "):
            continue
        f = dict(PAIR.findall(line))
        runs.append(
            {
                "setup": f["setup"],
                "model": f["model"],
                "dtype": f["dtype"],
                "ranks": int(f["ranks"]),
                "batch": int(f["batch"]),
                "big_batch": int(f["big_batch"]),
                "replicas_equal": f["replicas_equal"] == "True",
                "diffs": [float(d) for d in f["max_abs_diff"].split(",")],
            }
        )
    if not runs:
        raise ValueError("no compare lines")
    return runs


# Body text at 12 pt, for this figure only.
@plt.rc_context({"font.size": 12})
def draw(runs: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.6), dpi=100)
    labels = []
    for x, run in enumerate(runs):
        right = run["setup"] == "ddp" and run["model"] == "mlp"
        colour = RIGHT if right else WRONG
        steps = len(run["diffs"])
        xs = [x - 0.25 + 0.5 * k / max(1, steps - 1) for k in range(steps)]
        ax.plot(xs, run["diffs"], "-o", color=colour, markersize=6)
        ax.text(
            x,
            max(run["diffs"]) * 6,
            f"{max(run['diffs']):.1e}".replace("e-0", "e-"),
            ha="center",
            color=colour,
        )
        name = NAMES.get((run["setup"], run["model"]), run["setup"])
        label = f"{name}\n{run['dtype']}"
        if not run["replicas_equal"]:
            label += "\nranks differ"
        labels.append(label)
    first = runs[0]
    ax.set_xticks(range(len(runs)), labels)
    ax.tick_params(axis="x", length=0)
    ax.set_yscale("log")
    ax.set_ylim(1e-18, 1)
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_ylabel("largest weight difference\nfrom one process (log)")
    ax.set_title(
        f"{first['ranks']} ranks x batch {first['batch']} against one process"
        f" x batch {first['big_batch']}, after each of"
        f" {len(first['diffs'])} SGD steps",
        loc="left",
        fontsize=12,
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from", dest="source", type=Path, help="a saved output"
    )
    parser.add_argument(
        "--out", type=Path, default=HERE / "ddp_equals_big_batch.png"
    )
    args = parser.parse_args()
    if args.source:
        text = args.source.read_text()
    else:
        command = [sys.executable, str(SCRIPT)]
        print("running:", " ".join(command), flush=True)
        text = subprocess.run(
            command, capture_output=True, text=True, timeout=600, check=True
        ).stdout
    draw(parse(text), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
