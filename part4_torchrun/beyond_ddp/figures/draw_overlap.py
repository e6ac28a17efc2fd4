"""Draws one training step per rank as a timeline, step 2 above step 3: the
forward, backward(), the wait for the sums and the optimizer's step on one
row, each bucket's all-reduce on a lane of its own below. In step 2 every
all-reduce starts once backward() has returned; in step 3 they start from
the gradient hooks, while backward() still runs.

    python part4_torchrun/beyond_ddp/figures/draw_overlap.py

runs `torchrun --standalone --nproc_per_node=2
part4_torchrun/beyond_ddp/overlap_bench.py --sizes 8 --steps 5 --timeline`
and draws the `timeline` lines it prints (the last timed step, each rank's
own clock from the step's start). --from FILE draws a saved output instead;
--out FILE: the PNG.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BENCH = ["--sizes", "8", "--steps", "5", "--timeline"]
# Okabe-Ito
COLORS = {
    "forward": "#56B4E9",
    "backward": "#0072B2",
    "wait": "#E69F00",
    "step": "#009E73",
    "bucket": "#D55E00",
}
NAMES = {
    "after": "step 2: buckets all-reduced after backward()",
    "overlap": "step 3: buckets sent from the hooks, during backward()",
}
LINE = re.compile(
    r"^timeline variant=(\w+) rank=(\d+) what=(\w+)(?: bucket=(\d+))?"
    r" start_ms=([\d.]+) end_ms=([\d.]+)$",
    re.MULTILINE,
)


def parse(text: str) -> dict:
    """{variant: {rank: {forward, backward, wait, step: (start, end) in ms,
    buckets: [(start, end), ...] in the order sent}}} from the timeline
    lines of overlap_bench.py --timeline."""
    data: dict = {}
    for variant, rank, what, bucket, start, end in LINE.findall(text):
        row = data.setdefault(variant, {}).setdefault(int(rank), {})
        span = (float(start), float(end))
        if what == "bucket":
            buckets = row.setdefault("buckets", [])
            if int(bucket) != len(buckets):
                raise ValueError(f"bucket {bucket} out of order, rank {rank}")
            buckets.append(span)
        else:
            row[what] = span
    if sorted(data) != ["after", "overlap"]:
        raise ValueError(f"no timeline of both variants: {sorted(data)}")
    for rows in data.values():
        for row in rows.values():
            missing = {"forward", "backward", "wait", "step", "buckets"} - set(
                row
            )
            if missing:
                raise ValueError(f"timeline lines missing: {sorted(missing)}")
    return data


def draw(data: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 12})
    variants = ["after", "overlap"]
    ranks = sorted(data["after"])
    lanes = max(len(r["buckets"]) for v in variants for r in data[v].values())
    fig, panels = plt.subplots(
        2, 1, sharex=True, figsize=(9, 1.2 + 1.0 * len(ranks) * 2)
    )
    end = max(r["step"][1] for v in variants for r in data[v].values())
    for axes, variant in zip(panels, variants, strict=True):
        ticks, labels = [], []
        for i, rank in enumerate(ranks):
            row = data[variant][rank]
            # each rank: the computation on top, its buckets' lanes below
            top = i * 2.2
            for what in ("forward", "backward", "wait", "step"):
                start, stop = row[what]
                axes.barh(
                    top,
                    stop - start,
                    left=start,
                    height=0.7,
                    color=COLORS[what],
                    hatch="//" if what == "wait" else None,
                    edgecolor="white",
                    linewidth=0.5,
                )
            lane = 0.9 / lanes
            for b, (start, stop) in enumerate(row["buckets"]):
                axes.barh(
                    top + 0.55 + (b + 0.5) * lane,
                    stop - start,
                    left=start,
                    height=lane * 0.8,
                    color=COLORS["bucket"],
                )
            # where backward() returned, through the rank's lanes
            returned = row["backward"][1]
            axes.plot(
                [returned, returned],
                [top - 0.45, top + 1.5],
                color="#000000",
                linestyle=":",
                linewidth=1.2,
            )
            ticks += [top, top + 1.0]
            labels += [f"rank {rank}", f"rank {rank}'s buckets"]
        axes.set_yticks(ticks, labels)
        axes.set_ylim(len(ranks) * 2.2 - 0.5, -0.7)
        axes.set_title(NAMES[variant], loc="left", fontsize=12)
        axes.spines[["top", "right"]].set_visible(False)
        first = data[variant][ranks[0]]
        axes.text(
            first["backward"][1],
            len(ranks) * 2.2 - 0.55,
            " backward() returns",
            fontsize=11,
            va="bottom",
        )
    panels[-1].set_xlabel("ms from the step's start (each rank's clock)")
    panels[-1].set_xlim(0, end * 1.02)
    # a key in one row above the panels (the bars are too short to hold
    # their names)
    keys = [
        ("forward", "forward"),
        ("backward", "backward()"),
        ("wait", "waiting for the sums"),
        ("step", "optimizer step"),
        ("bucket", "a bucket's all-reduce"),
    ]
    handles = [
        plt.Rectangle(
            (0, 0), 1, 1, color=COLORS[w], hatch="//" if w == "wait" else None
        )
        for w, _ in keys
    ]
    fig.legend(
        handles,
        [name for _, name in keys],
        loc="upper center",
        ncol=5,
        frameon=False,
        fontsize=11,
        handlelength=1.2,
        columnspacing=1.0,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def run_bench() -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2"]
    command += ["part4_torchrun/beyond_ddp/overlap_bench.py", *BENCH]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if done.returncode:
        sys.exit(f"error: the benchmark failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="saved", help="a saved output")
    parser.add_argument("--out", default=str(HERE / "overlap.png"))
    args = parser.parse_args()
    text = Path(args.saved).read_text() if args.saved else run_bench()
    draw(parse(text), args.out)
    print(f"drew {args.out}")


if __name__ == "__main__":
    main()
