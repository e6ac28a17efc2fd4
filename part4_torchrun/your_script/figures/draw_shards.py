"""Draw the two ranks' shards of one epoch when each process draws its own
seed, beside rank 0's seed broadcast, from two runs of random_seed.py with
--show-shards.

A strip per rank, a cell per sample of the data set (128): filled where the
rank's DistributedSampler hands the sample out; then the samples on both
ranks and those on none.

    python part4_torchrun/your_script/figures/draw_shards.py
        runs, on 2 gloo ranks,
        torchrun ... random_seed.py --show-shards
        torchrun ... random_seed.py --show-shards --fix
        and draws shards.png
    python part4_torchrun/your_script/figures/draw_shards.py \\
        --from own.txt agreed.txt
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
SCRIPT = HERE.parent / "random_seed.py"
# Okabe-Ito: colours safe for colour-blind readers.
RANK_COLOURS = ["#0072B2", "#E69F00"]
BOTH, NONE = "#CC79A7", "#000000"
SEED = re.compile(r"^rank=(\d+) seed=(\d+)$")
SHARD = re.compile(r"^rank=(\d+) shard=([\d,]+)$")
COUNTS = re.compile(r"^samples=(\d+) on_both_ranks=(\d+) on_no_rank=(\d+)$")


def parse(text: str) -> dict:
    """{"seeds": {rank: seed}, "shards": {rank: [samples, as drawn]},
    "samples": the data set's size}."""
    seeds, shards, samples = {}, {}, None
    for line in text.splitlines():
        if match := SEED.match(line):
            seeds[int(match[1])] = int(match[2])
        elif match := SHARD.match(line):
            shards[int(match[1])] = [int(i) for i in match[2].split(",")]
        elif match := COUNTS.match(line):
            samples = int(match[1])
    if sorted(shards) != [0, 1] or sorted(seeds) != [0, 1] or not samples:
        raise ValueError("no seed and shard lines of ranks 0 and 1")
    return {"seeds": seeds, "shards": shards, "samples": samples}


def strips(run: dict) -> list[tuple[str, str, set[int]]]:
    """(label, colour, samples) of each strip of a run."""
    mine = [set(run["shards"][rank]) for rank in (0, 1)]
    found = [
        (f"rank {r} (seed {run['seeds'][r]})", RANK_COLOURS[r], mine[r])
        for r in (0, 1)
    ]
    nowhere = set(range(run["samples"])) - mine[0] - mine[1]
    found.append(
        (f"on both: {len(mine[0] & mine[1])}", BOTH, mine[0] & mine[1])
    )
    found.append((f"on none: {len(nowhere)}", NONE, nowhere))
    return found


# Body text at 12 pt, for this figure only.
@plt.rc_context({"font.size": 12})
def draw(data: dict, path: Path) -> None:
    """data: {"own": parse(run without --fix), "agreed": parse(--fix)}."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 4.6), dpi=100, sharex=True)
    titles = {
        "own": "Each process draws its own seed: the shards overlap",
        "agreed": "--fix: rank 0's seed, broadcast: disjoint shards",
    }
    for ax, key in zip(axes, ("own", "agreed"), strict=True):
        rows = strips(data[key])
        for row, (_, colour, samples) in enumerate(rows):
            ax.broken_barh(
                [(i, 0.9) for i in sorted(samples)], (-row - 0.4, 0.8),
                facecolors=colour,
            )  # fmt: skip
        ax.set_yticks(
            [-row for row in range(len(rows))], [label for label, *_ in rows]
        )
        ticks = ax.get_yticklabels()
        for tick, (_, colour, _) in zip(ticks, rows, strict=True):
            tick.set_color(colour)
        ax.tick_params(axis="y", length=0)
        ax.set_ylim(-len(rows) + 0.4, 0.6)
        ax.set_title(titles[key], loc="left", fontsize=12)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    size = data["own"]["samples"]
    axes[-1].set_xlim(0, size)
    axes[-1].set_xlabel(
        f"sample of the data set (0 to {size - 1}): one epoch of each rank's"
        " DistributedSampler"
    )
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from",
        dest="sources",
        nargs=2,
        type=Path,
        metavar=("OWN", "AGREED"),
        help="saved outputs: without --fix, then with it",
    )
    parser.add_argument("--out", type=Path, default=HERE / "shards.png")
    args = parser.parse_args()
    if args.sources:
        texts = [source.read_text() for source in args.sources]
    else:
        texts = []
        for fix in ([], ["--fix"]):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(SCRIPT), "--show-shards", *fix,
            ]  # fmt: skip
            print("running:", " ".join(command), flush=True)
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=600
            )
            if done.returncode:
                sys.exit(f"error: {command[5]} failed:\n{done.stderr}")
            texts.append(done.stdout)
    own, agreed = map(parse, texts)
    draw({"own": own, "agreed": agreed}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
