"""Draw a killed and resumed run of step 9 as a timeline: the steps each
attempt had done against wall time, the kill, the restart and the resume at
the last snapshot, beside the train loss of the run and of one that was
never interrupted.

It runs the command below twice (2.5 minutes on 2 CPU cores): first
killing a worker with SIGKILL in epoch 2, a moment after a snapshot, then
uninterrupted. Each run's output goes to the terminal as it comes, and to a
transcript (every line with the seconds since the start) in runs/figure/.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone
        --nproc_per_node=2 --max-restarts=2
        part4_torchrun/fault_tolerance/step09_exact_resume.py --dataset fake
        --epochs 3 --max-steps 12 --snapshot-every 4
        --snapshot runs/figure/killed.pt --checkpoint ''

    python part4_torchrun/fault_tolerance/figures/draw_resume.py
        runs both, draws resume.png
    python part4_torchrun/fault_tolerance/figures/draw_resume.py --from DIR
        draws from the transcripts of earlier runs (DIR/killed.txt and
        DIR/reference.txt)
    python part4_torchrun/fault_tolerance/figures/draw_resume.py \\
        --record FILE -- COMMAND...
        runs any command and writes its transcript to FILE
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SCRIPT = "part4_torchrun/fault_tolerance/step09_exact_resume.py"
EPOCHS, PER_EPOCH, EVERY = 3, 12, 4
# The kill: a moment after the snapshot at step 4 of epoch 2, half the
# time between two snapshots later, so that the steps since it are lost.
KILL_AFTER = f"1/{EPOCHS} epochs, {EVERY} steps done"
BLUE, ORANGE, GREEN = "#0072B2", "#E69F00", "#009E73"
VERMILLION, GREY = "#D55E00", "#777777"

SAVED = re.compile(r"saved snapshot .+: (\d+)/\d+ epochs(?:, (\d+) steps)?")
RESUMED = re.compile(r"resumed from .+: (\d+)/\d+ epochs(?:, (\d+) steps)?")
EPOCH = re.compile(r"^epoch (\d+)/\d+ train_loss=([\d.]+) .*train_samples=")
FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
RANK_0 = re.compile(r"^rank 0/\d+ device=")


def command(snapshot: str) -> list[str]:
    return [
        *(
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=2",
        ),
        *(SCRIPT, "--dataset", "fake", "--epochs", str(EPOCHS)),
        *("--max-steps", str(PER_EPOCH), "--snapshot-every", str(EVERY)),
        *("--snapshot", snapshot, "--checkpoint", ""),
    ]


def record(argv: list[str], path: Path, kill_after: str = "") -> int:
    """Run argv, its output passed on to ours as it comes, and written to
    path with the seconds since the start before each line. kill_after: a
    text that, once it appears, has the newest child of the process (a
    torchrun's worker) killed with SIGKILL half a snapshot's interval
    later."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    start = time.monotonic()
    # "torchrun": the one beside this python, if there is one (a venv's)
    beside = Path(sys.executable).with_name(Path(argv[0]).name)
    if argv[0] == beside.name and beside.exists():
        argv = [str(beside), *argv[1:]]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    lock, saves, killed = threading.Lock(), [], []

    def kill() -> None:
        found = subprocess.run(
            ["pgrep", "-n", "-P", str(process.pid)],
            capture_output=True,
            text=True,
        ).stdout.split()
        if found:
            os.kill(int(found[0]), signal.SIGKILL)

    def copy(stream, out, transcript) -> None:
        for line in stream:
            now = time.monotonic() - start
            with lock:
                out.write(line)
                out.flush()
                transcript.write(f"{now:.3f} {line}")
                if not line.startswith("saved snapshot"):
                    continue
                saves.append(now)
                # once: the first attempt only
                if kill_after and kill_after in line and not killed:
                    killed.append((saves[-1] - saves[-2]) / 2)
                    threading.Timer(killed[0], kill).start()

    with open(path, "w") as transcript:
        streams = [(process.stdout, sys.stdout), (process.stderr, sys.stderr)]
        readers = [
            threading.Thread(target=copy, args=(*pair, transcript))
            for pair in streams
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
    return process.wait()


def parse(text: str, per_epoch: int) -> dict:
    """What one run's transcript shows: {"attempts": [{"start_s",
    "points": [(seconds, steps done)]}], "kill": (seconds, local rank) or
    None, "resume": (seconds, steps done) or None, "losses": {epoch:
    (train loss as printed, float)}, "resumed_epoch": the epoch a resume
    went on with, or None}. Steps count from the run's start, per_epoch
    per epoch; a point is a snapshot (written after that many steps), or
    the resume."""
    attempts, kill, resume, losses, resumed_epoch = [], None, None, {}, None
    for row in text.splitlines():
        seconds, _, line = row.partition(" ")
        seconds = float(seconds)
        if RANK_0.search(line):
            # an attempt starts from nothing, unless it resumes (below)
            attempts.append({"start_s": seconds, "points": [(seconds, 0)]})
        elif match := SAVED.search(line):
            epochs, steps = int(match[1]), int(match[2] or 0)
            point = (seconds, epochs * per_epoch + steps)
            attempts[-1]["points"].append(point)
        elif match := RESUMED.search(line):
            epochs, steps = int(match[1]), int(match[2] or 0)
            resume = (seconds, epochs * per_epoch + steps)
            attempts[-1]["points"] = [resume]
            resumed_epoch = epochs + 1 if steps else None
        elif match := EPOCH.search(line):
            losses[int(match[1])] = (match[2], float(match[2]))
        elif (match := FAILED.search(line)) and kill is None:
            kill = (seconds, int(match[2]))
    if not attempts or not losses:
        raise ValueError("no training in this transcript")
    return {
        "attempts": attempts,
        "kill": kill,
        "resume": resume,
        "losses": losses,
        "resumed_epoch": resumed_epoch,
    }


def draw(data: dict, path: Path) -> None:
    """data: {"killed": parse(...), "reference": parse(...)}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 12})
    killed, reference = data["killed"], data["reference"]
    fig, (ax, loss_ax) = plt.subplots(
        1, 2, figsize=(9, 4.8), dpi=100, width_ratios=[2.3, 1]
    )
    # The uninterrupted run, then each attempt of the killed one.
    xs, ys = zip(*reference["attempts"][0]["points"], strict=True)
    ax.plot(xs, ys, "--", color=GREY, linewidth=1.5)
    ax.text(xs[-1], ys[-1], "never\ninterrupted ", color=GREY, ha="right")
    first, second = killed["attempts"][:2]
    for attempt, colour in [(first, BLUE), (second, ORANGE)]:
        xs, ys = zip(*attempt["points"], strict=True)
        ax.plot(xs, ys, "o-", color=colour, markersize=5, linewidth=2)
    ax.text(*first["points"][2], "attempt 1  ", color=BLUE, ha="right")
    ax.text(*second["points"][-1], "  attempt 2", color=ORANGE, va="center")
    # The kill, the steps since the last snapshot lost, the restart.
    saved_s, saved_step = first["points"][-1]
    kill_s, rank = killed["kill"]
    resume_s, resume_step = killed["resume"]
    ax.axvspan(saved_s, kill_s, color=VERMILLION, alpha=0.15, linewidth=0)
    ax.axvspan(kill_s, resume_s, color=GREY, alpha=0.15, linewidth=0)
    ax.plot([kill_s, resume_s], [resume_step] * 2, ":", color=GREY)
    ax.plot([kill_s], [saved_step], "X", color=VERMILLION, markersize=13)
    ax.annotate(
        f"kill -9 local rank {rank}: the\nsteps since the last\n"
        f"snapshot (step {saved_step}) are lost",
        (kill_s, saved_step),
        xytext=(4, 48),
        textcoords="offset points",
        ha="right",
        color=VERMILLION,
    )
    ax.annotate(
        f"restart, {resume_s - kill_s:.0f} s: resumes\nat that snapshot",
        (resume_s, resume_step),
        xytext=(6, -34),
        textcoords="offset points",
        color=ORANGE,
    )
    ax.set_xlabel("wall time since the launch (s)")
    ax.set_ylabel("training steps done")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    # The train loss of each epoch, as the epoch lines print it.
    epochs = sorted(reference["losses"])
    ref_loss = [reference["losses"][e][1] for e in epochs]
    loss_ax.plot(epochs, ref_loss, "o", color=GREY, markersize=11)
    resumed = killed["resumed_epoch"]
    for epoch, (_, loss) in sorted(killed["losses"].items()):
        if epoch == resumed:
            loss_ax.plot(epoch, loss, "D", color=VERMILLION, markersize=7)
            loss_ax.annotate(
                "after the resume:\nits last steps",
                (epoch, loss),
                xytext=(9, 0),
                textcoords="offset points",
                va="top",
                color=VERMILLION,
                fontsize=11,
            )
        else:
            loss_ax.plot(epoch, loss, "o", color=GREEN, markersize=5)
    loss_ax.set_title("train loss per epoch", loc="left", fontsize=12)
    for y, text, colour in [
        (0.1, "never interrupted", GREY),
        (0.02, "resumed", GREEN),
    ]:
        loss_ax.text(
            0.02,
            y,
            text,
            transform=loss_ax.transAxes,
            color=colour,
            fontsize=11,
        )
    loss_ax.set_xticks(epochs)
    loss_ax.set_xlabel("epoch")
    loss_ax.margins(x=0.25, y=0.35)
    for axis in (ax, loss_ax):
        for side in ("top", "right"):
            axis.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from", dest="source", type=Path, help="a folder of transcripts"
    )
    parser.add_argument("--out", type=Path, default=HERE / "resume.png")
    parser.add_argument("--record", type=Path, help="a transcript to write")
    parser.add_argument("argv", nargs="*", help="with --record: a command")
    args = parser.parse_args()
    if args.record:
        sys.exit(record(args.argv, args.record))
    folder = args.source or REPO / "runs" / "figure"
    if not args.source:
        folder.mkdir(parents=True, exist_ok=True)
        for name, kill_after in [("killed", KILL_AFTER), ("reference", "")]:
            snapshot = folder / f"{name}.pt"
            snapshot.unlink(missing_ok=True)
            argv = command(str(snapshot.relative_to(REPO)))
            print(f"== {name}: {' '.join(argv)}", flush=True)
            if record(argv, folder / f"{name}.txt", kill_after):
                sys.exit(f"error: the {name} run failed (see above)")
    data = {
        name: parse((folder / f"{name}.txt").read_text(), PER_EPOCH)
        for name in ("killed", "reference")
    }
    draw(data, args.out)
    print(f"drew {args.out}")


if __name__ == "__main__":
    main()
