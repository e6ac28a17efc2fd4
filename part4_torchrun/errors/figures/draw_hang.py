"""Draw a hang from the Flight Recorder: the collectives each rank entered,
when, and from which line of hang.py, from the records hang.py --fr-dump
writes when its collective times out.

For each rank, a row: each collective the recorder holds, at the moment the
rank entered it (seconds from the first one entered by any rank); the last
one as a bar, the wait, up to the collective timeout the record carries;
on it, the collective, its sequence number and the line that called it.

    python part4_torchrun/errors/figures/draw_hang.py
        runs torchrun --standalone --nproc_per_node=2
        part4_torchrun/errors/hang.py --fr-dump DIR (a temporary folder),
        draws hang.png
    python part4_torchrun/errors/figures/draw_hang.py --from DIR
        draws from the records of an earlier run (DIR/rank_0, DIR/rank_1)
"""

import argparse
import linecache
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "hang.py"
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7"]
TIMEOUT_COLOUR = "#D55E00"


def parse(folder: Path) -> dict:
    """{"ranks": [{"rank", "entries": [{"op", "seq", "start_s",
    "timeout_s", "line", "code"}]}]}, from the records rank_N in folder.
    start_s: seconds from the first collective any rank entered (the ranks
    of one machine share its clock); line: the line of hang.py that called
    the collective; code: that line's text, read from the file the record
    names ("" if it is not on this machine)."""
    ranks = []
    for path in sorted(folder.glob("rank_*")):
        record = pickle.loads(path.read_bytes())
        entries = []
        for entry in record["entries"]:
            # The innermost frame in hang.py: the line that called it.
            frame = next(
                f
                for f in entry["frames"]
                if Path(f["filename"]).name == SCRIPT.name
            )
            entries.append(
                {
                    "op": entry["profiling_name"].split(":")[-1],
                    "seq": entry["collective_seq_id"],
                    "created_ns": entry["time_created_ns"],
                    "timeout_s": entry["timeout_ms"] / 1000,
                    "file": Path(frame["filename"]).name,
                    "line": frame["line"],
                    "code": linecache.getline(
                        frame["filename"], frame["line"]
                    ).strip(),
                }
            )
        if not entries:
            raise ValueError(f"{path}: no collective recorded")
        ranks.append(
            {"rank": int(path.name.split("_")[1]), "entries": entries}
        )
    if len(ranks) < 2:
        raise ValueError(f"{folder}: fewer than 2 ranks' records")
    ranks.sort(key=lambda r: r["rank"])
    first = min(e["created_ns"] for r in ranks for e in r["entries"])
    for rank in ranks:
        for entry in rank["entries"]:
            entry["start_s"] = (entry.pop("created_ns") - first) / 1e9
    return {"ranks": ranks}


def draw(data: dict, path: Path) -> None:
    plt.rcParams.update({"font.size": 12})
    ranks = data["ranks"]
    fig, ax = plt.subplots(figsize=(9, 1.0 + 1.1 * len(ranks)), dpi=100)
    end = 0.0
    for rank in ranks:
        y = -rank["rank"]
        colour = COLOURS[rank["rank"] % len(COLOURS)]
        *done, last = rank["entries"]
        for entry in done:
            ax.plot(entry["start_s"], y, "o", color=colour, markersize=6)
        start, wait = last["start_s"], last["timeout_s"]
        end = max(end, start + wait)
        ax.barh(y, wait, left=start, height=0.62, color=colour, alpha=0.3)
        ax.plot(start, y, "o", color=colour, markersize=9)
        ax.text(
            start + 0.12,
            y,
            f"waits in {last['op']} #{last['seq']},"
            f" entered at {1000 * start:.1f} ms\n"
            f"{last['file']} line {last['line']}: {last['code']}",
            va="center",
        )
        ax.text(
            start + wait + 0.08,
            y,
            f"timeout\n({wait:g} s)",
            va="center",
            color=TIMEOUT_COLOUR,
        )
        ax.plot(
            [start + wait] * 2,
            [y - 0.31, y + 0.31],
            color=TIMEOUT_COLOUR,
            linewidth=2,
        )
    lasts = [r["entries"][-1] for r in ranks]
    if (
        len({e["seq"] for e in lasts}) == 1
        and len({e["op"] for e in lasts}) > 1
    ):
        title = (
            f"Every rank at collective #{lasts[0]['seq']}, but not the same"
            " collective: none can finish"
        )
    else:
        title = "The last collective each rank entered"
    ax.set_title(title, loc="left", fontsize=12)
    ax.set_yticks(
        [-r["rank"] for r in ranks], [f"rank {r['rank']}" for r in ranks]
    )
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(-0.2, end + 1.0)
    ax.set_ylim(-len(ranks) + 0.45, 0.55)
    ax.set_xlabel("time since the first collective entered (s)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from", dest="source", type=Path, help="a folder of records"
    )
    parser.add_argument("--out", type=Path, default=HERE / "hang.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        folder = args.source
        if folder is None:
            folder = Path(directory)
            # torchrun, as python -m: the same launcher
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(SCRIPT),
                "--fr-dump",
                str(folder),
            ]
            print("running:", " ".join(command), flush=True)
            # The run fails on its collective timeout: that is the point.
            run = subprocess.run(
                command, capture_output=True, text=True, timeout=300
            )
            if run.returncode == 0:
                sys.exit("hang.py did not hang:\n" + run.stdout)
        data = parse(folder)
    for rank in data["ranks"]:
        last = rank["entries"][-1]
        print(
            f"rank {rank['rank']}: {last['op']} #{last['seq']} entered at"
            f" {1000 * last['start_s']:.1f} ms, {last['file']} line"
            f" {last['line']}, timeout {last['timeout_s']:g} s"
        )
    draw(data, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
