"""Draw the replicas drifting apart when each rank decides alone, beside
the agreed decision, from two runs of decisions.py with --drift-every 1.

Top: each rank's learning rate, step by step (ReduceLROnPlateau lowers it
after an epoch of 16 steps). Bottom: the largest difference between the two
ranks' weights after each step, without and with --fix.

    python part4_torchrun/your_script/figures/draw_drift.py
        runs, on 2 gloo ranks,
        torchrun ... decisions.py --drift-every 1
        torchrun ... decisions.py --drift-every 1 --fix
        and draws drift.png
    python part4_torchrun/your_script/figures/draw_drift.py \\
        --from alone.txt agreed.txt
        draws from saved outputs of the two runs
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
SCRIPT = HERE.parent / "decisions.py"
STEPS_PER_EPOCH = 16
# Okabe-Ito: colours safe for colour-blind readers.
RANK_COLOURS = ["#0072B2", "#E69F00"]
ALONE, AGREED = "#D55E00", "#009E73"
EPOCH = re.compile(r"^epoch (\d+) rank (\d+) val_loss=\S+ lr=(\S+)$")
DRIFT = re.compile(r"^step=(\d+) replicas_max_abs_diff=(\S+)$")


def parse(text: str) -> dict:
    """{"drift": [(step, max |w0 - w1|)], "lr": {rank: [(epoch, lr)]}}:
    the lr each rank set after each epoch."""
    drift, lr = [], {}
    for line in text.splitlines():
        if match := DRIFT.match(line):
            drift.append((int(match[1]), float(match[2])))
        elif match := EPOCH.match(line):
            epoch, rank, rate = int(match[1]), int(match[2]), float(match[3])
            lr.setdefault(rank, []).append((epoch, rate))
    if not drift or sorted(lr) != [0, 1]:
        raise ValueError("no drift lines, or no epoch lines of ranks 0 and 1")
    return {"drift": drift, "lr": {r: sorted(lr[r]) for r in sorted(lr)}}


def lr_by_step(epochs: list[tuple[int, float]], first: float) -> tuple:
    """The lr in force at each step: `first`, then each epoch's new one."""
    steps, rates = [0], [first]
    for epoch, rate in epochs:
        steps.append(epoch * STEPS_PER_EPOCH)
        rates.append(rate)
    return steps, rates


# Body text at 12 pt, for this figure only.
@plt.rc_context({"font.size": 12})
def draw(data: dict, path: Path) -> None:
    """data: {"alone": parse(run without --fix), "agreed": parse(--fix)}."""
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 5.2), dpi=100, sharex=True,
        gridspec_kw={"height_ratios": [1, 1.5]},
    )  # fmt: skip
    alone, agreed = data["alone"], data["agreed"]
    last = max(step for step, _ in alone["drift"] + agreed["drift"])
    labels = {0: "rank 0 alone", 1: "rank 1 alone"}
    steps, rates = lr_by_step(agreed["lr"][0], 0.02)
    # Below rank 1's label when the two lines end together.
    below = 0.45 if rates[-1] == alone["lr"][1][-1][1] else 1
    top.text(
        last + 3, rates[-1] * below, "--fix: both ranks", color=AGREED,
        va="center",
    )  # fmt: skip
    for rank, epochs in alone["lr"].items():
        line, values = lr_by_step(epochs, 0.02)
        top.step(
            [*line, last], [*values, values[-1]], where="post",
            color=RANK_COLOURS[rank], linewidth=2.5 - rank,
        )  # fmt: skip
        top.text(
            last + 3, values[-1] * (1.25 if rank else 0.8), labels[rank],
            color=RANK_COLOURS[rank], va="center",
        )  # fmt: skip
    top.step(
        [*steps, last], [*rates, rates[-1]], where="post", color=AGREED,
        linestyle=(0, (4, 3)), linewidth=1.5,
    )  # fmt: skip
    top.set_yscale("log")
    top.set_ylabel("learning rate")
    top.set_title(
        "Each rank lowers its learning rate at its own epoch", loc="left"
    )

    for run, colour, label in (
        (alone, ALONE, "each rank decides alone"),
        (agreed, AGREED, "--fix: the decision agreed"),
    ):
        steps = [step for step, _ in run["drift"]]
        diffs = [diff for _, diff in run["drift"]]
        bottom.plot(steps, diffs, color=colour, linewidth=2)
        bottom.text(last + 3, diffs[-1], label, color=colour, va="center")
    split = first_split(alone["lr"])
    if split is not None:
        bottom.axvline(split, color="#000000", linewidth=0.8, linestyle=":")
        bottom.text(
            split - 3, max(d for _, d in alone["drift"]) * 0.9,
            f"the learning rates\npart after step {split}", ha="right",
            va="top",
        )  # fmt: skip
    bottom.set_ylabel("max |w rank 0 - w rank 1|")
    bottom.set_xlabel(
        f"training step ({STEPS_PER_EPOCH} steps an epoch, 2 gloo ranks)"
    )
    bottom.set_xlim(0, last)
    for ax in (top, bottom):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.subplots_adjust(right=0.74)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def first_split(lr: dict[int, list[tuple[int, float]]]) -> int | None:
    """The step after which the ranks' learning rates first differ."""
    for (epoch, a), (_, b) in zip(lr[0], lr[1], strict=False):
        if a != b:
            return epoch * STEPS_PER_EPOCH
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from",
        dest="sources",
        nargs=2,
        type=Path,
        metavar=("ALONE", "AGREED"),
        help="saved outputs: without --fix, then with it",
    )
    parser.add_argument("--out", type=Path, default=HERE / "drift.png")
    args = parser.parse_args()
    if args.sources:
        texts = [source.read_text() for source in args.sources]
    else:
        texts = []
        for fix in ([], ["--fix"]):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(SCRIPT), "--drift-every", "1", *fix,
            ]  # fmt: skip
            print("running:", " ".join(command), flush=True)
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=600
            )
            if done.returncode:
                sys.exit(f"error: {command[5]} failed:\n{done.stderr}")
            texts.append(done.stdout)
    alone, agreed = map(parse, texts)
    draw({"alone": alone, "agreed": agreed}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
