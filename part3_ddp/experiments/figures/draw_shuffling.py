"""Draw each rank's share of a data set, epoch by epoch, without and with
`DistributedSampler.set_epoch`, from the `indices` lines of shuffling.py.

One strip per rank per epoch: a cell per sample of the data set (16 integers),
filled where the rank draws that sample, numbered in the order the rank draws
it; a black frame marks a sample the rank did not have the epoch before.

    python part3_ddp/experiments/figures/draw_shuffling.py
        runs python part3_ddp/experiments/shuffling.py, draws shuffling.png
    python part3_ddp/experiments/figures/draw_shuffling.py --from out.txt
        draws from a saved output of shuffling.py
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "shuffling.py"
# Okabe-Ito: a colour per rank, safe for colour-blind readers.
RANK_COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7"]
INDICES = re.compile(r"^indices set_epoch=(\w+) epoch=(\d+) rank=(\d+) (\S+)$")
TITLES = {
    "off": "Without set_epoch: every epoch repeats epoch 0",
    "on": "With set_epoch(epoch): a new shuffle, samples change ranks",
}


def parse(text: str) -> dict[str, list[list[list[int]]]]:
    """{"off" | "on": drawn[epoch][rank], the samples in the order drawn}."""
    found: dict[str, dict[int, dict[int, list[int]]]] = {}
    for line in text.splitlines():
        match = INDICES.match(line)
        if match:
            flag, epoch, rank, indices = match.groups()
            epochs = found.setdefault(flag, {})
            drawn = [int(i) for i in indices.split(",")]
            epochs.setdefault(int(epoch), {})[int(rank)] = drawn
    if sorted(found) != ["off", "on"]:
        raise ValueError("no indices lines for set_epoch=off and on")
    return {
        flag: [
            [epochs[e][r] for r in sorted(epochs[e])] for e in sorted(epochs)
        ]
        for flag, epochs in found.items()
    }


# Body text at 12 pt, for this figure only.
@plt.rc_context({"font.size": 12})
def draw(data: dict[str, list[list[list[int]]]], path: Path) -> None:
    # The data set's size: the largest sample drawn, plus one.
    size = 1 + max(
        i for run in data.values() for e in run for r in e for i in r
    )
    epochs, ranks = len(data["off"]), len(data["off"][0])
    rows = epochs * ranks
    fig, axes = plt.subplots(
        2, 1, figsize=(9, 1.1 + 0.62 * rows), dpi=100, sharex=True
    )
    for ax, flag in zip(axes, ("off", "on"), strict=True):
        run = data[flag]
        labels, positions = [], []
        for epoch, shards in enumerate(run):
            for rank, drawn in enumerate(shards):
                # Epochs top to bottom, a small gap between them.
                y = -(epoch * (ranks + 0.5) + rank)
                colour = RANK_COLOURS[rank % len(RANK_COLOURS)]
                before = set(run[epoch - 1][rank]) if epoch else set(drawn)
                for sample in range(size):
                    ax.add_patch(
                        Rectangle(
                            (sample + 0.06, y - 0.4),
                            0.88,
                            0.8,
                            facecolor="none",
                            edgecolor="#BBBBBB",
                            linewidth=0.8,
                        )
                    )
                for order, sample in enumerate(drawn, 1):
                    new = sample not in before
                    ax.add_patch(
                        Rectangle(
                            (sample + 0.06, y - 0.4),
                            0.88,
                            0.8,
                            facecolor=colour,
                            edgecolor="black" if new else colour,
                            linewidth=2.5 if new else 0.8,
                        )
                    )
                    ax.text(
                        sample + 0.5,
                        y,
                        str(order),
                        ha="center",
                        va="center",
                        color="white",
                        fontsize=11,
                        fontweight="bold",
                    )
                if epoch:
                    moved = len(set(drawn) - before)
                    ax.text(
                        size + 0.2, y, f"{moved} new", va="center", fontsize=11
                    )
                labels.append(f"epoch {epoch}, rank {rank}")
                positions.append(y)
        ax.set_yticks(positions, labels)
        for tick, label in zip(ax.get_yticklabels(), labels, strict=True):
            rank = int(label.rsplit(" ", 1)[1])
            tick.set_color(RANK_COLOURS[rank % len(RANK_COLOURS)])
        ax.tick_params(axis="y", length=0)
        ax.set_xlim(0, size + 1.6)
        ax.set_ylim(min(positions) - 0.6, 0.6)
        ax.set_title(TITLES[flag], loc="left", fontsize=12)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xticks([i + 0.5 for i in range(size)], range(size))
    axes[-1].set_xlabel(
        f"sample of the data set (the integers 0 to {size - 1}); in a cell:"
        " the order the rank draws it"
    )
    axes[0].tick_params(axis="x", length=0)
    axes[0].spines["bottom"].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from", dest="source", type=Path, help="a saved output"
    )
    parser.add_argument("--out", type=Path, default=HERE / "shuffling.png")
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
