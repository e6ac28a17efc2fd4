"""Stress harness (a tool, not a test): many short 2-process launches of a training script
(MNIST's on real digits, part 4's on fake images), optionally beside a CPU load, counting the
launches that stall.

The launcher: torchrun, or for a script that reads srun's variables (SLURM_PROCID and no RANK),
a stand-in for srun that starts the 2 processes itself with SLURM_PROCID, SLURM_LOCALID,
SLURM_NTASKS, SLURM_NTASKS_PER_NODE, MASTER_ADDR and a free MASTER_PORT set, and ends the others
when one fails (srun --kill-on-bad-exit). The data: fake images for a script with a --dataset
option (--dataset fake, --fake-size, --max-steps), else MNIST digits (--data-dir).

A stall is a launch still running after --timeout seconds. Before it is killed, every process
of the launch dumps its Python stacks (faulthandler, on SIGUSR1) into the launch's log, so a
stuck DataLoader worker shows where it waits. Each launch runs in its own session and carries a
marker in its environment: on a timeout, everything with the marker is killed (torchrun starts
its workers in sessions of their own, and an orphaned loader worker leaves its parent's tree),
and the harness checks that nothing is left.

    python tests/stress_loader_workers.py -n 40 --load 1
    python tests/stress_loader_workers.py -n 40 --load 1 --script path/to/other_train.py --workers 4
    python tests/stress_loader_workers.py -n 40 --script solutions/mnist_classify_ddp.py
    python tests/stress_loader_workers.py -n 40 --script part4_torchrun/speed/speed3_workers.py \
        --workers 2 --max-steps 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autograder.run import FAKE_SRUN
from conftest import PYTHON, TORCHRUN, free_port, launch, with_environ
from mnist_data import first_digits, get_mnist_subset

# Imported at start-up by every process of a launch (PYTHONPATH): stacks on SIGUSR1. A fork
# inherits the handler, so a loader worker that never reached its loop dumps too.
DUMP_ON_SIGNAL = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1)\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--launches", type=int, default=20)
    parser.add_argument("--script", default="solutions/mnist_classify_ddp_torchrun.py")
    parser.add_argument(
        "--launcher",
        choices=["auto", "torchrun", "srun-env"],
        default="auto",
        help="auto: srun-env for a script that reads SLURM_PROCID and not RANK, else torchrun",
    )
    parser.add_argument("--workers", type=int, default=1, help="the script's --workers")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--train-digits", type=int, default=400)
    parser.add_argument("--test-digits", type=int, default=99)
    parser.add_argument("--fake-size", type=int, default=512, help="fake-data scripts' images")
    parser.add_argument("--max-steps", type=int, default=2, help="fake-data scripts' per epoch")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the launches")
    parser.add_argument("--timeout", type=float, default=60, help="seconds per launch")
    parser.add_argument("--logs", default=None, help="folder for the stalled launches' output")
    parser.add_argument("--minutes", type=float, default=None, help="start no launch after")
    return parser.parse_args()


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def one_launch(args: argparse.Namespace, data: Path | None, hooks: Path) -> tuple[str, str]:
    """One launch: ("ok" | "stall" | "failed", its stderr)."""
    marker = ("STRESS_LAUNCH", uuid.uuid4().hex)
    env = {
        "PYTHONPATH": str(hooks),
        # A rank left waiting in a collective waits past the launch's timeout: a stall is
        # caught while every process still sits where it stuck.
        "DDP_TIMEOUT_S": str(int(args.timeout) + 60),
        marker[0]: marker[1],
    }
    script_args = ["--epochs", str(args.epochs), "--workers", str(args.workers)]
    script_args += ["--batch-size", "32", "--checkpoint", ""]
    if args.fake:
        script_args += ["--dataset", "fake", "--fake-size", str(args.fake_size)]
        script_args += ["--max-steps", str(args.max_steps)]
    else:
        script_args += ["--data-dir", str(data)]
    if args.launcher == "torchrun":
        command = [TORCHRUN, "--standalone", "--nproc_per_node=2", args.script, *script_args]
    else:
        # what srun and the job script would set, for 2 tasks on one node; the autograder's
        # stand-in for srun starts the tasks and ends the others when one fails
        env.update(NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1")
        env.update(SLURM_NODEID="0", SLURM_STEP_ID="0")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        command = ["bash", "-c", FAKE_SRUN, "fake-srun", PYTHON, args.script, *script_args]

    def dump_stacks() -> None:
        # every process of the launch, orphaned loader workers too, into its stderr
        signal_all(with_environ("=".join(marker)), signal.SIGUSR1)
        time.sleep(2)

    run = launch(
        command,
        timeout=args.timeout,
        env=env,
        check=False,
        fail_on_timeout=False,
        before_kill=dump_stacks,
    )
    # Whatever is left (an orphaned worker of a stalled or failed launch) is killed.
    for _ in range(20):
        left = with_environ("=".join(marker))
        if not left:
            break
        signal_all(left, signal.SIGKILL)
        time.sleep(0.5)
    else:
        sys.exit(f"processes {left} survived SIGKILL")
    outcome = "stall" if run.timed_out else "ok" if run.returncode == 0 else "failed"
    return outcome, run.stderr


def main() -> None:
    args = parse_args()
    args.script = str(Path(args.script).resolve())
    source = Path(args.script).read_text()
    if args.launcher == "auto":
        srun_style = "SLURM_PROCID" in source and '"RANK"' not in source
        args.launcher = "srun-env" if srun_style else "torchrun"
    args.fake = '"--dataset"' in source
    workdir = Path(tempfile.mkdtemp(prefix="stress-"))
    logs = Path(args.logs) if args.logs else workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    hooks = workdir / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(DUMP_ON_SIGNAL)
    data = None
    if not args.fake:
        full = get_mnist_subset.write_mnist(workdir / "mnist")
        data = first_digits(full, workdir / "data", args.train_digits, args.test_digits)
    busy = [
        subprocess.Popen([PYTHON, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.load)
    ]
    counts = {"ok": 0, "stall": 0, "failed": 0}
    seconds = []
    # A SIGTERM (timeout(1), a job's end) ends the run as Ctrl-C would: the load is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else float("inf")
    try:
        bar = tqdm(range(args.launches), unit="launch")
        for number in bar:
            if time.monotonic() > deadline:
                break
            start = time.perf_counter()
            outcome, stderr = one_launch(args, data, hooks)
            seconds.append(time.perf_counter() - start)
            counts[outcome] += 1
            if outcome != "ok":
                (logs / f"{number:03d}-{outcome}.log").write_text(stderr)
            bar.set_postfix(counts)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    ok_seconds = sorted(s for s in seconds if s < args.timeout)
    median = ok_seconds[len(ok_seconds) // 2] if ok_seconds else float("nan")
    print(
        f"{len(seconds)} {args.launcher} launches of {args.script} --workers {args.workers}"
        f" beside {args.load} busy process(es) on {len(os.sched_getaffinity(0))} cores:"
        f" {counts['ok']} ok, {counts['stall']} stalled (> {args.timeout:g} s),"
        f" {counts['failed']} failed; median launch {median:.1f} s; logs in {logs}"
    )
    sys.exit(1 if counts["stall"] or counts["failed"] else 0)


if __name__ == "__main__":
    main()
