"""Bonus 1: strong scaling, a run on 1, 2, 4, ... processes, a CSV row each.

Strong scaling keeps the problem (one epoch of the same data) fixed and adds
processes, each with the same batch size and the same resources (one GPU, or
--threads CPU threads), so the ideal is "n processes, n times the samples/s".
The sweep reads each run's last epoch line, whose time ends when the slowest
rank has finished (the all-reduce of the epoch's totals). Without Slurm
(torchrun), then inside a Slurm job (srun):

    python solutions/scaling_sweep.py --procs 1 2 --csv runs/scaling.csv \
        -- --epochs 2
    sbatch solutions/job_scaling.sbatch --epochs 2

Then plot speedup and efficiency: solutions/scaling_analysis.ipynb.
"""

import argparse
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

EPOCH_LINE = re.compile(
    r"^epoch \d+/\d+ .*test_acc=(?P<acc>[\d.]+)% "
    r".*samples/s=(?P<rate>[\d.]+) epoch_s=(?P<secs>[\d.]+)$",
    re.M,
)
FIELDS = ["processes", "launcher", "samples_per_s", "epoch_s", "test_acc"]
SOLUTIONS = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    procs = [1, 2, 4, 8]
    parser.add_argument(
        "--procs", type=int, nargs="+", default=procs, help="processes per run"
    )
    launcher = "srun" if "SLURM_JOB_ID" in os.environ else "torchrun"
    parser.add_argument(
        "--launcher", choices=["torchrun", "srun"], default=launcher
    )
    threads = int(os.environ.get("OMP_NUM_THREADS", 1))
    parser.add_argument(
        "--threads",
        type=int,
        default=threads,
        help="per process, in every run",
    )
    parser.add_argument(
        "--csv", default="runs/scaling.csv", help="one row appended per run"
    )
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="after --: for the script",
    )
    args = parser.parse_args()
    args.script_args = [a for a in args.script_args if a != "--"]
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def command_for(launcher: str, processes: int) -> list[str]:
    if launcher == "torchrun":
        # One node: torchrun starts the processes.
        script = SOLUTIONS / "mnist_classify_ddp_torchrun.py"
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        nproc = f"--nproc_per_node={processes}"
        return [*torchrun, "--standalone", nproc, str(script)]
    # Inside a Slurm job: a job step of `processes` tasks (job_scaling.sbatch
    # exports MASTER_ADDR and MASTER_PORT), on as few nodes as hold them: a run
    # that fits on one node does not talk across nodes, so each point of the
    # curve measures one kind of link.
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", processes))
    nodes = f"--nodes={-(-processes // per_node)}"
    script = SOLUTIONS / "mnist_classify_ddp.py"
    srun = ["srun", f"--ntasks={processes}", nodes, "--kill-on-bad-exit=1"]
    return [*srun, sys.executable, str(script)]


def run_once(launcher, processes, threads, script_args, step) -> dict:
    # The same resources per process in every run.
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if launcher == "srun":
        # A fresh port per step (the previous step's may still be closing),
        # among the ten ports from MASTER_PORT that job_scaling.sbatch gives
        # this job.
        port = int(os.environ["MASTER_PORT"]) + step % 10
        env["MASTER_PORT"] = str(port)
    command = command_for(launcher, processes) + script_args
    log(f"$ OMP_NUM_THREADS={threads} {' '.join(command)}")
    result = subprocess.run(
        command, env=env, stdout=subprocess.PIPE, text=True
    )
    sys.stdout.write(result.stdout)
    epochs = list(EPOCH_LINE.finditer(result.stdout))
    if result.returncode != 0 or not epochs:
        sys.exit(
            f"error: the run with {processes} processes failed"
            f" (exit {result.returncode}) or printed no epoch line"
        )
    # The first epoch also pays for warm-up: report the last one.
    last = epochs[-1]
    rate, seconds, accuracy = (float(last[k]) for k in ("rate", "secs", "acc"))
    return {"samples_per_s": rate, "epoch_s": seconds, "test_acc": accuracy}


def append_row(path: Path, row: dict) -> None:
    new_file = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as out:
        writer = csv.DictWriter(out, FIELDS)
        if new_file:
            writer.writeheader()
        writer.writerow(row)


def main() -> None:
    args = parse_args()
    for step, processes in enumerate(args.procs):
        result = run_once(
            args.launcher, processes, args.threads, args.script_args, step
        )
        row = {"processes": processes, "launcher": args.launcher, **result}
        append_row(Path(args.csv), row)
        log(
            f"processes={processes} samples/s={result['samples_per_s']}"
            f" epoch_s={result['epoch_s']} test_acc={result['test_acc']}%"
            f" -> {args.csv}"
        )


if __name__ == "__main__":
    main()
