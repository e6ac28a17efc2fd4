"""Benchmark: samples/s of the course's scripts, per launcher, world size, threads and flag.

The companion of the speed steps. Its "flags" suite times the last of them,
part4_torchrun/speed/speed3_workers.py, which has every speed flag: in plain fp32 eager with no
loader workers, then with one speed flag at a time (--precision bf16 or fp16, --channels-last,
--compile, --workers 4), then with all of them (its defaults on a GPU). The "parts" suite times
every script of the course as written; "scaling" times DDP under torchrun at 1..--max-procs
ranks, on resnet18 (32x32 fake images) and on the
MNIST CNN (solutions/mnist_classify_ddp_torchrun.py, real digits), beside n copies of the
1-rank run started side by side (no communication: what the machine itself gives n processes),
and the world-of-one overhead (part 4 under python and torchrun against part 1).

It launches the real scripts, never a copy of their loop: --warmup untimed epochs (start-up,
allocator, torch.compile), then --repeats timed epochs, of which it keeps the median of the
`samples/s=` values. Speed is judged only as a ratio of two runs of the same invocation: same
machine, same load. Writes results.csv, results.png and summary.md (table and ratios) to --out.

    python part4_torchrun/tools/benchmark.py --suites flags                # the speed steps, CPU
    python part4_torchrun/tools/benchmark.py --suites flags --batch-size 256 --steps 50   # one GPU
    python part4_torchrun/tools/benchmark.py --suites scaling              # DDP at 1..cores ranks
    python part4_torchrun/tools/benchmark.py                               # all: ~30 min on 2 cores
    python part4_torchrun/tools/benchmark.py --smoke --out /tmp/bench      # 2 tiny runs: works?
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
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
# label -> (script, how it starts its processes)
CIFAR_SCRIPTS = {
    "part1": ("part1_single/train.py", "python"),
    "part2 DP": ("part2_dp/train.py", "python"),
    "step1 group": ("part3_ddp/step1_process_group.py", "spawn"),
    "step2 DDP": ("part3_ddp/step2_ddp_wrap.py", "spawn"),
    "step3 sampler": ("part3_ddp/step3_distributed_sampler.py", "spawn"),
    "step4 device": ("part3_ddp/step4_device_placement.py", "spawn"),
    "step5 checkpoint": ("part3_ddp/step5_checkpoint.py", "spawn"),
    "part4": ("part4_torchrun/train.py", "torchrun"),
}
PART1, PART4 = CIFAR_SCRIPTS["part1"][0], CIFAR_SCRIPTS["part4"][0]
FAST = "part4_torchrun/speed/speed3_workers.py"  # the last speed step: all flags


def fast_flags(precision="fp32", layout="--no-channels-last", graph="--no-compile", workers=0):
    return ("--precision", precision, layout, graph, "--workers", str(workers))


# label -> the speed steps' flags, all spelled out, as its defaults differ on CPU and GPU
FAST_RUNS = {
    "fp32 eager": fast_flags(),
    "--precision bf16": fast_flags(precision="bf16"),
    "--precision fp16": fast_flags(precision="fp16"),
    "--channels-last": fast_flags(layout="--channels-last"),
    "--compile": fast_flags(graph="--compile"),
    "--workers 4": fast_flags(workers=4),
    "all on (GPU defaults)": fast_flags("bf16", "--channels-last", "--compile", 4),
}
EAGER = FAST_RUNS["fp32 eager"]
MNIST_SCRIPT = "solutions/mnist_classify_ddp_torchrun.py"
# No loader process, as in train.py: n ranks keep to n cores.
MNIST_FLAGS = ("--workers", "0")
FIELDS = [
    *("suite", "label", "workload", "script", "launcher", "world_size", "threads"),
    *("threads_seen", "batch_per_process", "global_batch", "flags", "samples_per_s"),
    *("timed_epochs", "gpu_util_pct", "status", "wall_s", "copies"),
]
RATE = re.compile(r"^epoch \d+/\d+ .* samples/s=(?P<rate>[\d.]+) epoch_s=[\d.]+$", re.M)
THREADS = re.compile(r"threads=(\d+)")
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
HAS_GPU = shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


@dataclass
class Config:
    suite: str
    label: str
    # "resnet18" (or --model) or "mnist"
    workload: str
    script: str
    # python, spawn (the script's own mp.spawn), torchrun or srun
    launcher: str
    world_size: int
    # OMP_NUM_THREADS per process, or "default": the script decides
    threads: str
    # per process
    batch: int
    flags: tuple[str, ...] = ()
    # the same launch, this many at once, side by side: their samples/s add up
    copies: int = 1
    result: dict = field(default_factory=dict)

    def key(self) -> tuple:
        what = (self.workload, self.script, self.launcher, self.world_size, self.threads)
        return (*what, self.batch, self.flags, self.copies)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    suites = ["parts", "scaling", "flags"]
    parser.add_argument("--suites", nargs="+", choices=suites, default=suites)
    parser.add_argument("--max-procs", type=int, default=min(CORES, 8), help="world sizes 1..N")
    parser.add_argument("--model", default="resnet18", help="timm model of the CIFAR scripts")
    parser.add_argument("--batch-size", type=int, default=16, help="per process, CIFAR scripts")
    parser.add_argument("--mnist-batch-size", type=int, default=128, help="per process, MNIST")
    parser.add_argument("--steps", type=int, default=4, help="batches per epoch and rank (CIFAR)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs per launch")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs; the median is kept")
    parser.add_argument("--mnist-data", default="data/mnist-5k", help="written if missing")
    parser.add_argument("--out", default="part4_torchrun/tools/benchmark_results")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--smoke", action="store_true", help="2 tiny launches: checks the pipeline")
    args = parser.parse_args()
    if args.smoke:
        args.suites, args.model, args.max_procs = ["smoke"], "test_resnet", 1
        args.steps, args.repeats, args.batch_size = 2, 1, 8
    return args


def log(message: str) -> None:
    # above the progress bar, not through it
    tqdm.write(message)


def srun_usable() -> bool:
    # inside a Slurm allocation
    return shutil.which("srun") is not None and "SLURM_JOB_ID" in os.environ


def plan(args: argparse.Namespace) -> list[Config]:
    """Every launch once: a config that two suites need is measured once, found by both."""
    sizes, model, b = range(1, args.max_procs + 1), args.model, args.batch_size
    configs: list[Config] = []

    def add(suite: str, label: str, *rest, **kw) -> None:
        config = Config(suite, label, *rest, **kw)
        if config.key() not in {c.key() for c in configs}:
            configs.append(config)

    if "smoke" in args.suites:
        add("parts", "part1 python n=1", model, PART1, "python", 1, "default", b)
        add("parts", "part4 python n=1", model, PART4, "python", 1, "default", b)
    # What a learner gets: each script as written, its own threads.
    if "parts" in args.suites:
        for label, (script, launcher) in CIFAR_SCRIPTS.items():
            for n in [1] if launcher == "python" else sizes:
                add("parts", f"{label} {launcher} n={n}", model, script, launcher, n, "default", b)
        add("parts", "part4 python n=1", model, PART4, "python", 1, "default", b)
        for n in sizes if srun_usable() else []:
            add("parts", f"part4 srun n={n}", model, PART4, "srun", n, "default", b)
    # torchrun, the same threads per rank at every world size: 1, cores / ranks, all cores
    if "scaling" in args.suites:
        workloads = [
            (model, PART4, b, ()),
            ("mnist", MNIST_SCRIPT, args.mnist_batch_size, MNIST_FLAGS),
        ]
        # the world of one: DDP and the launcher against part 1's plain loop
        add("parts", "part1 python n=1", model, PART1, "python", 1, "default", b)
        add("parts", "part4 python n=1", model, PART4, "python", 1, "default", b)
        add("parts", "part4 torchrun n=1", model, PART4, "torchrun", 1, "default", b)
        for workload, script, batch, flags in workloads:
            run = (workload, script, "torchrun")
            for n in sizes:
                if n > 1:
                    # n independent 1-rank runs at once: the machine's share, no all-reduce
                    label = f"{workload} {n} x torchrun n=1 t=1 side by side"
                    add("scaling", label, *run, 1, "1", batch, flags, copies=n)
                for t in sorted({"1", str(max(1, CORES // n)), str(CORES)}):
                    label = f"{workload} torchrun n={n} t={t} weak"
                    add("scaling", label, *run, n, t, batch, flags)
                # strong scaling: one rank's batch, split over n ranks
                if n > 1 and batch % n == 0:
                    label = f"{workload} torchrun n={n} t=1 strong"
                    add("scaling", label, *run, n, "1", batch // n, flags)
    # the speed step under plain python, a world of one
    if "flags" in args.suites:
        for label, flags in FAST_RUNS.items():
            add("flags", f"fast {label}", model, FAST, "python", 1, "default", b, flags)
    return configs


def command(config: Config, args: argparse.Namespace) -> list[str]:
    n, script = config.world_size, str(REPO / config.script)
    prefix = {
        "python": [sys.executable],
        "spawn": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
        "srun": ["srun", f"--ntasks={n}", "--kill-on-bad-exit=1", sys.executable],
    }[config.launcher]
    if config.launcher == "torchrun":
        prefix.append(f"--nproc_per_node={n}")
    common = ["--epochs", str(args.warmup + args.repeats), "--checkpoint", ""]
    common += ["--batch-size", str(config.batch), *config.flags]
    # a fixed data set (4,000 digits): an epoch is 4000 / (batch * n) steps
    if config.workload == "mnist":
        return [*prefix, script, "--data-dir", args.mnist_data, *common]
    # Fake images, sized so that each rank has exactly --steps batches. --max-steps also caps
    # steps 1-2, whose ranks all read the whole set (their samples/s is one rank's).
    data = ["--dataset", "fake", "--fake-size", str(config.batch * args.steps * n)]
    data += ["--max-steps", str(args.steps), "--model", config.workload]
    spawn = ["--nprocs", str(n)] if config.launcher == "spawn" else []
    return [*prefix, script, *data, *spawn, *common]


def environment(config: Config) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT")}
    if config.threads != "default":
        env["OMP_NUM_THREADS"] = config.threads
    # srun: a fresh port per job step, as the last step's may still be closing
    if config.launcher == "srun":
        with socket.socket() as sock:
            sock.bind(("", 0))
            env["MASTER_PORT"] = str(sock.getsockname()[1])
    return env


class GpuSampler:
    """nvidia-smi's utilisation of GPU 0 every 200 ms while a launch runs (none on a CPU)."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.process = None
        if HAS_GPU:
            query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
            query += ["-i", "0", "-lms", "200"]
            self.process = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line))

    def busy_percent(self) -> str:
        """Mean utilisation from the first busy sample on (start-up and data set-up left out)."""
        if self.process is None:
            return ""
        self.process.terminate()
        first = next((i for i, s in enumerate(self.samples) if s > 0), len(self.samples))
        busy = self.samples[first:]
        return f"{statistics.mean(busy):.0f}" if busy else "0"


def measure(config: Config, args: argparse.Namespace) -> dict:
    cmd = command(config, args)
    started, sampler = time.perf_counter(), GpuSampler()
    kw = dict(cwd=REPO, env=environment(config), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    processes = [
        subprocess.Popen(cmd, text=True, start_new_session=True, **kw) for _ in range(config.copies)
    ]
    outputs, codes = [], []
    try:
        for process in processes:
            left = max(1.0, args.timeout - (time.perf_counter() - started))
            outputs.append(process.communicate(timeout=left))
            codes.append(process.returncode)
    except BaseException as error:
        # a timeout, Ctrl-C or kill: the launchers and every rank they started
        for process in processes:
            os.killpg(process.pid, signal.SIGKILL)
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        outputs = [process.communicate() for process in processes]
        codes = ["timeout"]
    wall, gpu = time.perf_counter() - started, sampler.busy_percent()
    stdout, stderr = "\n".join(o for o, _ in outputs), "\n".join(e for _, e in outputs)
    # each copy's timed epochs; side by side, their medians add up
    per_copy = [[float(m["rate"]) for m in RATE.finditer(o)][args.warmup :] for o, _ in outputs]
    rates = [r for copy in per_copy for r in copy]
    seen = THREADS.search(stdout)
    ok = set(codes) == {0} and all(len(copy) == args.repeats for copy in per_copy)
    if not ok:
        log(f"FAILED {config.label}: $ {' '.join(cmd)}\n{stderr.strip()[-1500:]}")
    total = sum(statistics.median(copy) for copy in per_copy) if ok else 0
    return {
        "samples_per_s": round(total, 2) if ok else "",
        "timed_epochs": ";".join(f"{r:g}" for r in rates),
        "threads_seen": seen[1] if seen else "",
        "gpu_util_pct": gpu,
        "status": "ok" if ok else f"failed ({process.returncode})",
        "wall_s": round(wall, 1),
    }


def row(c: Config) -> dict:
    batches = {"batch_per_process": c.batch, "global_batch": c.batch * c.world_size}
    return {**vars(c), **batches, "flags": " ".join(c.flags), **c.result}


# ---- the ratios: looked up by what was run, not by label ----


def rate(configs: list[Config], **want) -> float | None:
    want.setdefault("copies", 1)
    for c in configs:
        if all(getattr(c, k) == v for k, v in want.items()) and c.result.get("status") == "ok":
            return c.result["samples_per_s"]
    return None


def pct(a: float | None, b: float | None, scale: float = 1.0) -> str:
    return f"{100 * a / (b * scale):.0f}%" if a and b else "n/a"


def ratios(configs: list[Config], args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(what, value, goal) lines; value "n/a" when a run it needs is missing or failed."""
    out: list[tuple[str, str, str]] = []
    # DDP at world size 1 against part 1: the price of the process group and DDP's hooks
    part1 = rate(configs, script=PART1, world_size=1, threads="default", flags=())
    for c in configs:
        if c.world_size > 1 or c.threads != "default" or c.flags or c.script == PART1:
            continue
        got = c.result.get("samples_per_s")
        overhead = f"{100 * (1 - got / part1):.1f}%" if got and part1 else "n/a"
        goal = "<= 5%" if c.script == PART4 else ""
        out.append((f"overhead at n=1: {c.label} vs part1 (1 - ratio)", overhead, goal))
    for workload in [args.model, "mnist"]:
        at = dict(workload=workload, launcher="torchrun")
        batch = args.batch_size if workload != "mnist" else args.mnist_batch_size
        one = rate(configs, **at, world_size=1, threads="1")
        full = rate(configs, **at, world_size=1, threads=str(CORES))
        goal = {"mnist": ">= 85%", "resnet18": ">= 75%"}.get(workload, "")
        for n in range(2, args.max_procs + 1):
            weak = rate(configs, **at, world_size=n, threads="1", batch=batch)
            strong = rate(configs, **at, world_size=n, threads="1", batch=batch // n)
            over = rate(configs, **at, world_size=n, threads=str(CORES), batch=batch)
            head = f"{workload} n={n}"
            side = rate(configs, **at, world_size=1, threads="1", batch=batch, copies=n)
            out += [
                (f"{head} weak scaling vs n=1, 1 thread per rank", pct(weak, one, n), goal),
                # what the machine gives n processes that never talk: DDP cannot beat it
                (f"{head} side by side (no all-reduce) vs n=1", pct(side, one, n), ""),
                (f"{head} weak scaling vs side by side (DDP's own cost)", pct(weak, side), ""),
                (f"{head} strong scaling vs n=1, 1 thread per rank", pct(strong, one, n), ""),
                (f"{head} x {CORES} threads (oversubscribed) vs n=1", pct(over, full, n), ""),
                (f"{head} x 1 thread vs n=1 x {CORES} threads (speed-up)", pct(weak, full), ""),
            ]
    # the same training code, started by another launcher
    for n in range(2, args.max_procs + 1):
        at = dict(world_size=n, threads="default")
        spawn = rate(configs, script=CIFAR_SCRIPTS["step5 checkpoint"][0], **at)
        torchrun = rate(configs, script=PART4, launcher="torchrun", **at)
        srun = rate(configs, script=PART4, launcher="srun", **at)
        out.append((f"launcher n={n}: part4 torchrun vs step5 mp.spawn", pct(torchrun, spawn), ""))
        if srun:
            out.append((f"launcher n={n}: part4 srun vs step5 mp.spawn", pct(srun, spawn), ""))
    eager = rate(configs, script=FAST, flags=EAGER)
    for c in configs:
        if c.script == FAST and c.flags != EAGER:
            got = c.result.get("samples_per_s")
            out.append((f"speed step: {c.label} vs fp32 eager", pct(got, eager), ""))
    return out


def verdict(what: str, value: str, goal: str) -> str:
    """What a ratio says against its goal, or why its runs cannot support one: a launch that ran
    faster than its baseline means the machine's load changed between them, not a gain."""
    if value == "n/a":
        return ""
    number = float(value.rstrip("%"))
    if what.startswith("overhead") and number < 0:
        return " (below 0: within noise, the two runs saw different loads)"
    if "weak scaling" in what and number > 100:
        return " (above 100%: other load slowed the n=1 run; measure again)"
    if not goal:
        return ""
    limit = float(goal.split()[1].rstrip("%"))
    met = number <= limit if goal.startswith("<=") else number >= limit
    return f" (goal {goal}: {'met' if met else 'NOT met'})"


def write_outputs(configs: list[Config], lines: list, args: argparse.Namespace, load: str) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(row(c) for c in configs)
    device = "a GPU" if HAS_GPU else "no GPU"
    made = (
        f"`python {' '.join(sys.argv)}`, {time.strftime('%Y-%m-%d')}: {CORES} CPU cores, "
        f"{device}; load average {load} (start, end; above {CORES}: other jobs shared the "
        f"cores). Warm-up {args.warmup} epoch(s), then the median of {args.repeats} timed "
        "epochs; results.csv has every flag and epoch."
    )
    text = [
        textwrap.fill(made, 100, break_on_hyphens=False),
        "",
        "| run | launcher | n | threads (seen) | batch/proc | samples/s | timed epochs |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        got = c.result.get("samples_per_s") or c.result.get("status")
        threads = f"{c.threads} ({c.result.get('threads_seen') or '?'})"
        cells = [c.label, c.launcher, c.world_size, threads, c.batch, got]
        text.append("| " + " | ".join(map(str, cells)) + f" | {c.result.get('timed_epochs')} |")
    text += ["", "| ratio | value | goal |", "|---|---|---|"]
    text += [f"| {what} | {value} | {goal} |" for what, value, goal in lines]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    plot(configs, args, out / "results.png")


def scaling_rate(done: list[Config], workload: str, batch: int, kind: str, n: int):
    """samples/s of n ranks under torchrun, 1 thread each (weak: each with `batch`; strong:
    `batch` split over them), or of n 1-rank runs at once (side by side); at n=1, one run."""
    at = dict(workload=workload, launcher="torchrun", threads="1")
    if kind == "side by side":
        return rate(done, **at, world_size=1, batch=batch, copies=n)
    return rate(done, **at, world_size=n, batch=batch // n if kind == "strong" else batch)


def plot(configs: list[Config], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    # files only, no display
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in configs if c.result.get("status") == "ok"]
    size = (14, max(4, 0.3 * len(done) + 1))
    fig, (bars, scaling) = plt.subplots(1, 2, figsize=size, width_ratios=[3, 2])
    colors = {"parts": "tab:blue", "scaling": "tab:green", "flags": "tab:orange"}
    rates = [c.result["samples_per_s"] for c in done]
    bars.barh([c.label for c in done], rates, color=[colors[c.suite] for c in done])
    bars.invert_yaxis()
    bars.set_xscale("log")
    bars.set_xlabel("samples/s (median of timed epochs, log scale)")
    bars.tick_params(axis="y", labelsize=7)
    sizes = range(1, args.max_procs + 1)
    for workload in [args.model, "mnist"]:
        batch = args.batch_size if workload != "mnist" else args.mnist_batch_size
        for kind in ["weak", "strong", "side by side"]:
            points = [(n, scaling_rate(done, workload, batch, kind, n)) for n in sizes]
            points = [(n, r) for n, r in points if r]
            if len(points) > 1 and points[0][0] == 1:
                speedup = [r / points[0][1] for _, r in points]
                scaling.plot([n for n, _ in points], speedup, "o-", label=f"{workload} {kind}")
    scaling.plot([1, args.max_procs], [1, args.max_procs], "k--", label="ideal")
    scaling.set(xlabel="ranks (1 thread each, torchrun)", ylabel="speed-up vs 1 rank")
    scaling.set_title("scaling")
    scaling.legend()
    fig.suptitle(
        f"{time.strftime('%Y-%m-%d')}, {CORES} cores, {'GPU' if HAS_GPU else 'CPU'}; "
        f"warm-up {args.warmup} epoch(s), median of {args.repeats}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def ensure_mnist(args: argparse.Namespace, configs: list[Config]) -> None:
    if not any(c.workload == "mnist" for c in configs):
        return
    if not (Path(args.mnist_data) / "MNIST" / "raw").is_dir():
        writer = REPO / "exercises" / "get_mnist_subset.py"
        subprocess.run([sys.executable, str(writer), args.mnist_data], check=True)


def main() -> None:
    # `kill` ends the current launch too
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args = parse_args()
    configs = plan(args)
    ensure_mnist(args, configs)
    load = f"{os.getloadavg()[0]:.1f}"
    log(f"{len(configs)} launches; {CORES} cores; load average {load}; srun: {srun_usable()}")
    for config in tqdm(configs, desc="benchmark", unit="launch"):
        config.result = measure(config, args)
        got = config.result["samples_per_s"] or config.result["status"]
        epochs, wall = config.result["timed_epochs"], config.result["wall_s"]
        log(f"{config.label}: {got} samples/s (epochs {epochs}, {wall} s)")
    lines = ratios(configs, args)
    write_outputs(configs, lines, args, f"{load}, {os.getloadavg()[0]:.1f}")
    for what, value, goal in lines:
        log(f"{what}: {value}{verdict(what, value, goal)}")
    log(f"wrote results.csv, results.png and summary.md to {args.out}")
    if any(c.result["status"] != "ok" for c in configs):
        sys.exit("error: some launches failed: see above")


if __name__ == "__main__":
    main()
