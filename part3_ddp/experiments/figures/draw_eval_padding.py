"""Draw the test set split over the ranks by DistributedSampler (padded) and by
a strided split (no padding), from the output of eval_padding.py.

For each split, a row per rank: the first three and the last three samples of
its shard, by position in the shard; the samples counted more than once in
vermillion; at the right, the predictions counted and the accuracy, against
one process over the whole test set.

    python part3_ddp/experiments/figures/draw_eval_padding.py
        runs python part3_ddp/experiments/eval_padding.py, draws
        eval_padding.png
    python part3_ddp/experiments/figures/draw_eval_padding.py --from out.txt
        draws from a saved output of eval_padding.py
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
SCRIPT = HERE.parent / "eval_padding.py"
PAIR = re.compile(r"(\w+)=(\S+)")
TWICE, PLAIN, TEXT = "#D55E00", "#DDDDDD", "#000000"


def fields(line: str) -> dict[str, str]:
    return dict(PAIR.findall(line))


def parse(text: str) -> dict:
    """{"reference": {correct, total, acc}, "padded" | "strided": {"shards":
    [{rank, total, first, last}], correct, total, acc, twice}}."""
    data: dict = {}
    for line in text.splitlines():
        kind, f = line.split(" ", 1)[0], fields(line)
        if kind == "reference":
            data["reference"] = {
                "correct": int(f["correct"]),
                "total": int(f["total"]),
                "acc": float(f["acc"].rstrip("%")),
            }
        elif kind == "shard":
            split = data.setdefault(f["sampler"], {"shards": []})
            split["shards"].append(
                {
                    "rank": int(f["rank"]),
                    "total": int(f["total"]),
                    "first": [int(i) for i in f["first"].split(",")],
                    "last": [int(i) for i in f["last"].split(",")],
                }
            )
        elif kind == "global" and f.get("method") == "all_reduce":
            twice = f["twice"]
            data[f["sampler"]].update(
                correct=int(f["correct"]),
                total=int(f["total"]),
                acc=float(f["acc"].rstrip("%")),
                twice=[]
                if twice == "none"
                else [int(i) for i in twice.split(",")],
            )
    if {"reference", "padded", "strided"} - set(data):
        raise ValueError("no reference, padded or strided lines")
    return data


# Body text at 12 pt, for this figure only.
@plt.rc_context({"font.size": 12})
def draw(data: dict, path: Path) -> None:
    ranks = len(data["padded"]["shards"])
    fig, axes = plt.subplots(2, 1, figsize=(9, 1.4 + 1.05 * ranks), dpi=100)
    longest = max(
        s["total"]
        for split in ("padded", "strided")
        for s in data[split]["shards"]
    )
    # Columns: positions 1, 2, 3, a gap, then the last three positions.
    columns = [1, 2, 3, None, longest - 2, longest - 1, longest]
    reference = data["reference"]
    for ax, split in zip(axes, ("padded", "strided"), strict=True):
        run = data[split]
        for shard in run["shards"]:
            y = -shard["rank"]
            total = shard["total"]
            cells = dict(zip([1, 2, 3], shard["first"], strict=True))
            cells.update(
                zip([total - 2, total - 1, total], shard["last"], strict=True)
            )
            for x, position in enumerate(columns):
                if position is None:
                    ax.text(x + 0.5, y, "...", ha="center", va="center")
                    continue
                sample = cells.get(position)
                if sample is None:
                    # This shard is one shorter: nothing at that position.
                    ax.add_patch(
                        Rectangle(
                            (x + 0.05, y - 0.38),
                            0.9,
                            0.76,
                            facecolor="none",
                            edgecolor="#999999",
                            linestyle="--",
                        )
                    )
                    continue
                twice = sample in run["twice"]
                ax.add_patch(
                    Rectangle(
                        (x + 0.05, y - 0.38),
                        0.9,
                        0.76,
                        facecolor=TWICE if twice else PLAIN,
                        edgecolor="none",
                    )
                )
                ax.text(
                    x + 0.5,
                    y,
                    f"{sample:,}",
                    ha="center",
                    va="center",
                    color="white" if twice else TEXT,
                    fontweight="bold" if twice else "normal",
                )
            ax.text(
                len(columns) + 0.2,
                y,
                f"{total:,} samples",
                va="center",
            )
        same = run["acc"] == reference["acc"]
        summary = (
            f"{run['total']:,} predictions\n"
            f"accuracy {run['acc']:.4f}%\n"
            + ("= one process" if same else "one process:")
            + ("" if same else f" {reference['acc']:.4f}%")
        )
        ax.text(
            len(columns) + 2.6,
            -(ranks - 1) / 2,
            summary,
            va="center",
            color=TWICE if not same else TEXT,
        )
        ax.set_yticks(
            [-s["rank"] for s in run["shards"]],
            [f"rank {s['rank']}" for s in run["shards"]],
        )
        ax.set_xticks(
            [x + 0.5 for x, p in enumerate(columns) if p is not None],
            [f"{p:,}" for p in columns if p is not None],
        )
        ax.tick_params(length=0)
        ax.set_xlim(0, len(columns) + 5.4)
        ax.set_ylim(-ranks + 0.45, 0.55)
        if run["twice"]:
            twice = " and ".join(f"{i:,}" for i in run["twice"])
            title = f"DistributedSampler: padded; samples {twice} count twice"
        else:
            title = f"Strided (rank r takes r, r + {ranks}, ...): each once"
        ax.set_title(title, loc="left", fontsize=12)
        for side in ax.spines.values():
            side.set_visible(False)
    axes[-1].set_xlabel(
        "position in the rank's shard (in a cell: the sample's index in the"
        " test set)",
        loc="left",
    )
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from", dest="source", type=Path, help="a saved output"
    )
    parser.add_argument("--out", type=Path, default=HERE / "eval_padding.png")
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
