"""Bonus 1: a strong-scaling sweep. The same training run on 1, 2, 4, ... processes; one CSV row each.

Strong scaling keeps the problem fixed (same data, same per-process batch size) and adds
processes; every process gets the same resources (one GPU, or --threads CPU threads), so the
ideal is "n processes, n times the samples/s". The training scripts time each epoch between
two barriers (the workshop's hint), and the sweep reads their last epoch line:

    python solutions/scaling_sweep.py --procs 1 2 --csv runs/scaling.csv -- --epochs 2 --data-dir data
    sbatch solutions/job_scaling.sbatch --epochs 2          # the same with srun, inside a Slurm job

Then plot speedup and efficiency with the notebook solutions/scaling_analysis.ipynb.
"""

import argparse
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

EPOCH_LINE = re.compile(r"^epoch \d+/\d+ .*test_acc=(?P<acc>[\d.]+)% .*samples/s=(?P<rate>[\d.]+) epoch_s=(?P<secs>[\d.]+)$", re.M)
FIELDS = ["processes", "launcher", "samples_per_s", "epoch_s", "test_acc"]
SOLUTIONS = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8], help="process counts to run")
    parser.add_argument("--launcher", choices=["torchrun", "srun"], default="srun" if "SLURM_JOB_ID" in os.environ else "torchrun")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)),
                        help="CPU threads per process, the same in every run (default: OMP_NUM_THREADS, else 1)")
    parser.add_argument("--csv", default="runs/scaling.csv", help="rows are appended: one per run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="after --: arguments for the training script")
    args = parser.parse_args()
    args.script_args = [a for a in args.script_args if a != "--"]
    return args


def log(message: str) -> None:
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def command_for(launcher: str, processes: int) -> list[str]:
    if launcher == "torchrun":  # one node: torchrun starts the processes
        script = SOLUTIONS / "mnist_classify_ddp_torchrun.py"
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", str(script)]
    # Inside a Slurm job: a job step with `processes` tasks (job_scaling.sbatch exports MASTER_ADDR/PORT).
    script = SOLUTIONS / "mnist_classify_ddp.py"
    return ["srun", f"--ntasks={processes}", "--kill-on-bad-exit=1", sys.executable, str(script)]


def run_once(launcher: str, processes: int, threads: int, script_args: list[str]) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))  # same resources per process in every run
    if launcher == "srun":  # a fresh port per step: the previous step's port may still be closing
        env["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + processes)
    command = command_for(launcher, processes) + script_args
    log(f"$ OMP_NUM_THREADS={threads} {' '.join(command)}")
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(result.stdout)
    epochs = list(EPOCH_LINE.finditer(result.stdout))
    if result.returncode != 0 or not epochs:
        sys.exit(f"run with {processes} processes failed (exit {result.returncode}) or printed no epoch line")
    last = epochs[-1]  # the first epoch also pays for warm-up: report the last one
    return {"samples_per_s": float(last["rate"]), "epoch_s": float(last["secs"]), "test_acc": float(last["acc"])}


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
    for processes in args.procs:
        result = run_once(args.launcher, processes, args.threads, args.script_args)
        append_row(Path(args.csv), {"processes": processes, "launcher": args.launcher, **result})
        log(f"processes={processes} samples/s={result['samples_per_s']} epoch_s={result['epoch_s']} "
            f"test_acc={result['test_acc']}% -> {args.csv}")


if __name__ == "__main__":
    main()
