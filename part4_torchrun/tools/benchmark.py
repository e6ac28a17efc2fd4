"""Benchmark: samples/s of the course's scripts, per launcher, world size, threads and flag.

The companion of the speed steps. Its "flags" suite times them (part4_torchrun/speed/): speed 3,
speed3_workers.py, in plain fp32 eager with no loader workers, then with one speed flag at a time
(--precision bf16 or fp16, --channels-last, --compile, --workers 4), then with all of them (its
defaults on a GPU); speed 4, speed4_device_data.py, with --device-data. Each of these rows asks
whether the loader or the model bounds it, with two more launches: its ceiling (the same script and
flags, its DataLoaders replaced by one batch already on the device: the model's step alone, DDP at a
world of one included) and its loader alone (the script's own training DataLoader, the model step
taken out). On a GPU the suite runs only the rows that answer that question (fp32 eager, speed 4
--device-data, speed 4 all on; --every-flag runs them all), each launch within its own timeout: the
GPU command below ends within 3 minutes. The "parts" suite times every script of the course as
written; "scaling" times DDP under torchrun at 1..--max-procs ranks, on resnet18 (32x32 fake images)
and on the MNIST CNN (solutions/mnist_classify_ddp_torchrun.py, real digits), beside n copies of the
1-rank run started side by side (no communication: what the machine itself gives n processes), and
the world-of-one overhead (part 4 under python and torchrun against part 1).

It launches the real scripts, never a copy of their loop: --warmup untimed epochs (start-up,
allocator, torch.compile), then --repeats timed epochs, of which it keeps the median of the
`samples/s=` values. Speed is judged only as a ratio of two runs of the same invocation: same
machine, same load. Writes results.csv and summary.md (tables and ratios) to --out, and
results.png for the parts and scaling suites (the flags suite's picture, each run beside its
ceiling and loader alone, is the speed chapter's figure: part4_torchrun/speed/figures/
draw_speed.py --from OUT/results.csv), also when launches fail or time out (a row with that
status) and when it is interrupted (Ctrl-C, kill: what it measured, the rest "not run").

    python part4_torchrun/tools/benchmark.py --suites flags                # the speed steps, CPU
    python part4_torchrun/tools/benchmark.py --suites flags --batch-size 256 --steps 10 \
        --repeats 1                                                     # one GPU, 3 min at most
    python part4_torchrun/tools/benchmark.py --suites scaling              # DDP at 1..cores ranks
    python part4_torchrun/tools/benchmark.py                               # all: ~30 min on 2 cores
    python part4_torchrun/tools/benchmark.py --smoke --out /tmp/bench      # 4 tiny runs: works?
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import importlib.metadata
import importlib.util
import itertools
import math
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
FAST = "part4_torchrun/speed/speed3_workers.py"  # speed 3: every flag of speeds 1-3
# draws the flags suite's runs from results.csv (the speed chapter's figure)
SPEED_FIGURE = "part4_torchrun/speed/figures/draw_speed.py"
SPEED4 = "part4_torchrun/speed/speed4_device_data.py"  # speed 3's flags and --device-data


def switch(flag: str, on: bool) -> str:
    return f"--{flag}" if on else f"--no-{flag}"


@dataclass(frozen=True)
class Knobs:
    """The speed steps' flags, all spelled out, as their defaults differ on CPU and GPU."""

    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    workers: int = 0
    device_data: bool = False

    @property
    def script(self) -> str:
        return SPEED4 if self.device_data else FAST

    def flags(self) -> tuple[str, ...]:
        flags = ("--precision", self.precision, switch("channels-last", self.channels_last))
        flags += (switch("compile", self.compile), "--workers", str(self.workers))
        return (*flags, "--device-data") if self.device_data else flags

    def ceiling(self) -> Knobs:
        """What the model step depends on: speed 3, no loader knob (its loader is replaced)."""
        return Knobs(self.precision, self.channels_last, self.compile)

    def loader(self) -> Knobs:
        """What the training loader depends on; no compile: the model never sees a batch. With
        --device-data the training set is a tensor on the device: --workers serves the test
        loader alone."""
        return Knobs(workers=0 if self.device_data else self.workers, device_data=self.device_data)


ALL_ON = Knobs("bf16", True, True, 4)
FLAG_RUNS = {
    "speed 3 fp32 eager": Knobs(),
    "speed 3 --precision bf16": Knobs("bf16"),
    "speed 3 --precision fp16": Knobs("fp16"),
    "speed 3 --channels-last": Knobs(channels_last=True),
    "speed 3 --compile": Knobs(compile=True),
    "speed 3 --workers 4": Knobs(workers=4),
    "speed 3 all on (GPU defaults)": ALL_ON,
    "speed 4 --device-data": Knobs(device_data=True),
    "speed 4 all on (GPU defaults)": Knobs("bf16", True, True, 4, device_data=True),
}
EAGER = FLAG_RUNS["speed 3 fp32 eager"].flags()
# The flags rows, per machine (--every-flag: all of them anywhere). A GPU gets the rows that say
# whether the loader or the model bounds it, within 3 minutes; a CPU every knob, speed 4's all
# on left out (its knobs are speed 3's, measured one by one).
CPU_FLAG_RUNS = tuple(label for label in FLAG_RUNS if label != "speed 4 all on (GPU defaults)")
GPU_FLAG_RUNS = ("speed 3 fp32 eager", "speed 4 --device-data", "speed 4 all on (GPU defaults)")
# seconds per launch: on a CPU, and on one GPU without and with --compile (compiling takes
# most of the latter); --timeout overrides them
CPU_TIMEOUT_S = 900.0
GPU_TIMEOUT_S = {False: 20.0, True: 35.0}
MNIST_SCRIPT = "solutions/mnist_classify_ddp_torchrun.py"
# No loader process, as in train.py: n ranks keep to n cores.
MNIST_FLAGS = ("--workers", "0")
FIELDS = [
    *("suite", "label", "workload", "script", "launcher", "world_size", "threads"),
    *("threads_seen", "batch_per_process", "global_batch", "flags", "samples_per_s"),
    *("timed_epochs", "gpu_util_pct", "status", "wall_s", "copies", "timeout_s"),
    *("ceiling_samples_per_s", "pct_of_ceiling", "loader_samples_per_s", "loader_batches_per_s"),
    "bound_by",
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
    # "ceiling" or "loader": the script under this file's --probe (see probe()); "": as written
    probe: str = ""
    # seconds the launch may take; plan() sets it
    timeout: float = CPU_TIMEOUT_S
    # a run's two probes, where it has them
    ceiling: Config | None = field(default=None, repr=False)
    loader: Config | None = field(default=None, repr=False)
    result: dict = field(default_factory=dict)

    def key(self) -> tuple:
        what = (self.workload, self.script, self.launcher, self.world_size, self.threads)
        return (*what, self.batch, self.flags, self.copies, self.probe)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument(
        "--timeout",
        type=float,
        help=f"seconds per launch; default {CPU_TIMEOUT_S:g} on a CPU, on a GPU "
        f"{GPU_TIMEOUT_S[False]:g} ({GPU_TIMEOUT_S[True]:g} with --compile)",
    )
    parser.add_argument(
        "--every-flag", action="store_true", help="flags suite: every row, on a GPU too (> 3 min)"
    )
    parser.add_argument("--smoke", action="store_true", help="4 tiny launches: checks the pipeline")
    parser.add_argument(
        "--probe",
        nargs=argparse.REMAINDER,
        metavar="KIND SCRIPT ARGS",
        help="one launch's work, which the benchmark starts: ceiling or loader of SCRIPT ARGS",
    )
    args = parser.parse_args(argv)
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


def plan(args: argparse.Namespace, gpu: bool = HAS_GPU) -> list[Config]:
    """Every launch once, in order, each with its timeout: a config that two suites or two rows
    need is measured once, found by both."""
    sizes, model, b = range(1, args.max_procs + 1), args.model, args.batch_size
    configs: list[Config] = []

    def add(suite: str, label: str, *rest, **kw) -> Config:
        config = Config(suite, label, *rest, **kw)
        found = next((c for c in configs if c.key() == config.key()), None)
        if found is None:
            configs.append(config)
        return found or config

    def with_probes(suite: str, label: str, run: tuple, ceiling: tuple, loader: tuple) -> None:
        """A run of (script, flags) under python, a world of one, then its ceiling and its
        loader alone, each (script, flags) too; a probe that an earlier run shares is reused."""

        def one(suite: str, label: str, script: str, flags: tuple, probe: str = "") -> Config:
            return add(suite, label, model, script, "python", 1, "default", b, flags, probe=probe)

        config = one(suite, label, *run)
        config.ceiling = one("ceiling", f"ceiling: {label}", *ceiling, probe="ceiling")
        config.loader = one("loader", f"loader alone: {label}", *loader, probe="loader")

    if "smoke" in args.suites:
        add("parts", "part1 python n=1", model, PART1, "python", 1, "default", b)
        with_probes("parts", "part4 python n=1", *[(PART4, ())] * 3)
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
    # the speed steps under plain python, a world of one, each with its ceiling and loader alone
    if "flags" in args.suites:
        for label in FLAG_RUNS if args.every_flag else GPU_FLAG_RUNS if gpu else CPU_FLAG_RUNS:
            knobs = FLAG_RUNS[label]
            ceiling, loader = knobs.ceiling(), knobs.loader()
            runs = [(k.script, k.flags()) for k in (knobs, ceiling, loader)]
            with_probes("flags", label, *runs)
    for config in configs:
        config.timeout = launch_timeout(config, args, gpu)
    return configs


def launch_timeout(config: Config, args: argparse.Namespace, gpu: bool) -> float:
    if args.timeout:
        return args.timeout
    return GPU_TIMEOUT_S["--compile" in config.flags] if gpu else CPU_TIMEOUT_S


def bound_s(configs: list[Config]) -> float:
    """The longest the launches can take: each ends by its timeout, one after another."""
    return sum(c.timeout for c in configs)


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
    if config.probe:
        prefix += [str(Path(__file__).resolve()), "--probe", config.probe]
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


def failure(stderr: str, codes: list) -> str:
    """Why a launch failed, in one line: the last line of its stderr that names an error (the
    exception, or a script's `error:` line), else its last line, else its exit status."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"Error|error:|Exception|Killed", line)]
    line = (named or lines or [f"exit status {' '.join(map(str, codes))}"])[-1]
    return line if len(line) <= 200 else line[:190] + " [...]"


def process_tree(root: int) -> list[int]:
    """root and every process under it, from Linux's /proc (elsewhere root alone): torchrun
    starts its workers in sessions of their own, which killing its process group misses."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (command) state ppid ...": the command may hold spaces and parentheses
            pid, rest = stat.read_text().rsplit(")", 1)
            parents[int(pid.split(" (")[0])] = int(rest.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, added = [root], True
    while added:
        new = [pid for pid, parent in parents.items() if parent in tree and pid not in tree]
        tree, added = tree + new, bool(new)
    return tree


def kill(processes: list[subprocess.Popen]) -> None:
    """Each launch's process group, and every process under it, whatever its group."""
    trees = [process_tree(process.pid) for process in processes]
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    for pid in {pid for tree in trees for pid in tree}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


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
            left = max(0.1, config.timeout - (time.perf_counter() - started))
            outputs.append(process.communicate(timeout=left))
            codes.append(process.returncode)
    except BaseException as error:
        # a timeout, Ctrl-C or kill: the launchers and every rank they started
        kill(processes)
        sampler.busy_percent()
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
    if codes == ["timeout"]:
        status = "timed out"
    elif set(codes) == {0}:
        status = f"failed: {len(rates)} of {args.repeats * config.copies} timed epochs printed"
    else:
        status = f"failed: {failure(stderr, codes)}"
    if not ok:
        log(f"{status.upper()}: {config.label}: $ {' '.join(cmd)}\n{stderr.strip()[-1500:]}")
    total = sum(statistics.median(copy) for copy in per_copy) if ok else 0
    return {
        "samples_per_s": round(total, 2) if ok else "",
        "timed_epochs": ";".join(f"{r:g}" for r in rates),
        "threads_seen": seen[1] if seen else "",
        "gpu_util_pct": gpu,
        "status": "ok" if ok else status,
        "wall_s": round(wall, 1),
    }


# ---- the probes: the ceiling and the loader alone, each in a launch of its own ----


class OnDevice:
    """A DataLoader's stand-in, for the ceiling: as many batches as the loader would give, each
    the same random batch of the data set's image shape, made once, already on the device."""

    def __init__(self, dataset, batch_size: int = 1, sampler=None, **_) -> None:
        import torch

        self.batches = math.ceil(len(dataset if sampler is None else sampler) / batch_size)
        shape = dataset[0][0].shape
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.images = torch.randn(batch_size, *shape, device=device)
        # the course's 10 classes
        self.labels = torch.randint(0, 10, (batch_size,), device=device)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        return itertools.repeat((self.images, self.labels), self.batches)


def loader_only(model, loader, optimizer, device, max_steps, *rest, augment=None):
    """train_one_epoch's stand-in, for the loader alone: the same batches of the script's own
    loader, copied to the device as the script copies them, and speed 4's uint8 batches through
    its augment() on the device as its train_one_epoch does; counted; no model, no step."""
    import torch

    steps = min(len(loader), max_steps or len(loader))
    seen = 0
    for images, labels in itertools.islice(loader, steps):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if augment is not None and images.dtype == torch.uint8:
            images = augment(images)
        seen += len(labels)
    # no gradients: a step that changes nothing, so that the scheduler finds one before its own
    optimizer.step()
    # (summed loss, correct, images), as train_one_epoch returns: the epoch line's samples/s
    return torch.tensor([0.0, 0.0, seen], dtype=torch.float64, device=device)


def probe(kind: str, script: str, script_args: list[str]) -> None:
    """One probe launch: the script's own parse_args() and main(), with one part replaced.
    ceiling: its DataLoaders by OnDevice, so that its epochs time its model step alone (the
    model, DDP at a world of one, the optimizer, autocast and GradScaler, channels-last and
    compile, as its flags say); loader: its train_one_epoch by loader_only. Its epoch lines,
    warm-up and clock are the script's own."""
    spec = importlib.util.spec_from_file_location("probed_script", REPO / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.argv = [script, *script_args]
    parsed = module.parse_args()
    if kind == "ceiling":
        module.DataLoader = OnDevice
    elif kind == "loader":
        augment = getattr(module, "augment", None)  # speed 4's, on the device
        module.train_one_epoch = functools.partial(loader_only, augment=augment)
    else:
        sys.exit(f"error: --probe {kind!r}: ceiling or loader")
    module.main(parsed)


def loader_or_model(run: Config) -> dict:
    """A run's ceiling and loader alone, its share of the ceiling, and which bounds it: the
    loader where alone it gives fewer samples/s than the model step takes on the device."""

    def ok(c: Config | None) -> float | None:
        return c.result.get("samples_per_s") if c and c.result.get("status") == "ok" else None

    got, ceiling, loader = ok(run), ok(run.ceiling), ok(run.loader)
    bound = ("loader" if loader < ceiling else "model") if loader and ceiling else ""
    return {
        "ceiling_samples_per_s": ceiling or "",
        "pct_of_ceiling": round(100 * got / ceiling, 1) if got and ceiling else "",
        "loader_samples_per_s": loader or "",
        "loader_batches_per_s": round(loader / run.batch, 2) if loader else "",
        "bound_by": bound,
    }


def row(c: Config) -> dict:
    batches = {"batch_per_process": c.batch, "global_batch": c.batch * c.world_size}
    probed = loader_or_model(c) if c.ceiling or c.loader else {}
    own = {"flags": " ".join(c.flags), "timeout_s": c.timeout}
    return {**vars(c), **batches, **own, **c.result, **probed}


# ---- the ratios: looked up by what was run, not by label ----


def rate(configs: list[Config], **want) -> float | None:
    """samples/s of the first run (not a probe) that matches `want` and ended well."""
    want.setdefault("copies", 1)
    want.setdefault("probe", "")
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
        if c.world_size > 1 or c.threads != "default" or c.flags or c.script == PART1 or c.probe:
            continue
        got = c.result.get("samples_per_s")
        overhead = f"{100 * (1 - got / part1):.1f}%" if got and part1 else "n/a"
        goal = "<= 5%" if c.script == PART4 else ""
        out.append((f"overhead at n=1: {c.label} vs part1 (1 - ratio)", overhead, goal))
    for workload in [args.model, "mnist"] if "scaling" in args.suites else []:
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
    for n in range(2, args.max_procs + 1) if "parts" in args.suites else []:
        at = dict(world_size=n, threads="default")
        spawn = rate(configs, script=CIFAR_SCRIPTS["step5 checkpoint"][0], **at)
        torchrun = rate(configs, script=PART4, launcher="torchrun", **at)
        srun = rate(configs, script=PART4, launcher="srun", **at)
        out.append((f"launcher n={n}: part4 torchrun vs step5 mp.spawn", pct(torchrun, spawn), ""))
        if srun:
            out.append((f"launcher n={n}: part4 srun vs step5 mp.spawn", pct(srun, spawn), ""))
    # each speed row against speed 3 in fp32 eager, at the same batch
    eager = rate(configs, script=FAST, flags=EAGER)
    for c in configs:
        if c.suite == "flags" and c.flags != EAGER:
            got = c.result.get("samples_per_s")
            out.append((f"speed step: {c.label} vs speed 3 fp32 eager", pct(got, eager), ""))
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


def cell(value) -> str:
    return str(value).replace("|", "\\|")


def loader_or_model_section(configs: list[Config]) -> list[str]:
    """summary.md's table of the probed runs, and a line each: the loader or the model?"""
    probed = [c for c in configs if c.ceiling or c.loader]
    if not probed:
        return []
    eager = rate(configs, script=FAST, flags=EAGER)
    text = [
        "## Loader or model",
        "",
        textwrap.fill(
            "ceiling: the same script and flags, its DataLoaders replaced by one batch already "
            "on the device (the model step alone: model, DDP at a world of one, optimizer, "
            "autocast, channels-last, compile). loader alone: the script's own training "
            "DataLoader, its batches copied to the device as the script copies them, no "
            "model. Both timed as the runs (warm-up, then the median of the timed epochs).",
            100,
            break_on_hyphens=False,
        ),
        "",
        "| configuration | samples/s | ceiling | % of ceiling | loader alone: samples/s "
        "(batches/s) | bound by | vs speed 3 fp32 eager |",
        "|---|---|---|---|---|---|---|",
    ]
    lines = []
    for c in probed:
        got = c.result.get("samples_per_s") or c.result.get("status", "not run")
        found = loader_or_model(c)
        ceiling = found["ceiling_samples_per_s"] or (c.ceiling and c.ceiling.result.get("status"))
        loader = found["loader_samples_per_s"]
        alone = (
            f"{loader} ({found['loader_batches_per_s']})"
            if loader
            else c.loader.result.get("status")
        )
        share = f"{found['pct_of_ceiling']:.0f}%" if found["pct_of_ceiling"] != "" else "n/a"
        versus = pct(c.result.get("samples_per_s"), eager) if c.suite == "flags" else ""
        cells = [c.label, got, ceiling, share, alone, found["bound_by"] or "n/a", versus]
        text.append("| " + " | ".join(cell(x) for x in cells) + " |")
        if found["bound_by"] == "loader":
            lines.append(
                f"- {c.label}: the loader bounds it: alone it gives {loader} samples/s, below "
                f"the {found['ceiling_samples_per_s']} samples/s of the model step."
            )
        elif found["bound_by"] == "model":
            lines.append(
                f"- {c.label}: the model bounds it: the loader alone gives {loader} samples/s, "
                f"above the {found['ceiling_samples_per_s']} samples/s of the model step."
            )
        else:
            lines.append(f"- {c.label}: not known: its ceiling or its loader alone is missing.")
    return [*text, "", *lines, ""]


def write_outputs(
    configs: list[Config], lines: list, args: argparse.Namespace, load: str
) -> list[str]:
    """results.csv, summary.md and, where there is something to draw, results.png: the names
    of the files written."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(row(c) for c in configs)
    device = "a GPU" if HAS_GPU else "no GPU"
    try:
        torch = f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch = "no torch"
    made = (
        f"`python {' '.join(sys.argv)}`, {time.strftime('%Y-%m-%d')}: {CORES} CPU cores, "
        f"{device}, {torch}; load average {load} (start, end; above {CORES}: other jobs shared "
        f"the cores). {len(configs)} launches, each within its timeout (results.csv: "
        f"timeout_s), {bound_s(configs):.0f} s at most in all. Warm-up {args.warmup} epoch(s), "
        f"then the median of {args.repeats} timed epochs; results.csv has every flag and epoch."
    )
    text = [
        textwrap.fill(made, 100, break_on_hyphens=False),
        "",
        "| run | launcher | n | threads (seen) | batch/proc | samples/s | timed epochs |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        got = c.result.get("samples_per_s") or c.result.get("status", "not run")
        threads = f"{c.threads} ({c.result.get('threads_seen') or '?'})"
        cells = [c.label, c.launcher, c.world_size, threads, c.batch, got]
        cells.append(c.result.get("timed_epochs", ""))
        text.append("| " + " | ".join(cell(x) for x in cells) + " |")
    text += ["", *loader_or_model_section(configs)]
    text += ["## Ratios", "", "| ratio | value | goal |", "|---|---|---|"]
    text += [f"| {what} | {value} | {goal} |" for what, value, goal in lines]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    drawn = plot(configs, args, out / "results.png")
    return ["results.csv", "summary.md", *(["results.png"] if drawn else [])]


def scaling_rate(done: list[Config], workload: str, batch: int, kind: str, n: int):
    """samples/s of n ranks under torchrun, 1 thread each (weak: each with `batch`; strong:
    `batch` split over them), or of n 1-rank runs at once (side by side); at n=1, one run."""
    at = dict(workload=workload, launcher="torchrun", threads="1")
    if kind == "side by side":
        return rate(done, **at, world_size=1, batch=batch, copies=n)
    return rate(done, **at, world_size=n, batch=batch // n if kind == "strong" else batch)


def plot(configs: list[Config], args: argparse.Namespace, path: Path) -> bool:
    """results.png: samples/s of the parts and scaling suites' launches and, with the scaling
    suite, the speed-up per rank count. The flags suite's runs, ceilings and loaders alone are
    the speed chapter's figure, drawn from results.csv by its own script (SPEED_FIGURE). False
    when there is nothing here to draw."""
    shown = [c for c in configs if c.suite in ("parts", "scaling")]
    if not shown:
        return False
    import matplotlib

    # files only, no display
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in shown if c.result.get("status") == "ok"]
    scaling = "scaling" in args.suites
    size = (14 if scaling else 9, max(4, 0.3 * len(done) + 1))
    fig, panels = plt.subplots(1, 2 if scaling else 1, figsize=size, squeeze=False)
    bars = panels[0, 0]
    colors = {"parts": "tab:blue", "scaling": "tab:green"}
    rates = [c.result["samples_per_s"] for c in done]
    bars.barh([c.label for c in done], rates, color=[colors[c.suite] for c in done])
    bars.invert_yaxis()
    if done:
        bars.set_xscale("log")
    else:
        bars.text(0.5, 0.5, "no launch ended well", ha="center", transform=bars.transAxes)
    bars.set_xlabel("samples/s (median of timed epochs, log scale)")
    bars.tick_params(axis="y", labelsize=7)
    if scaling:
        plot_scaling(done, args, panels[0, 1])
    fig.suptitle(
        f"{time.strftime('%Y-%m-%d')}, {CORES} cores, {'GPU' if HAS_GPU else 'CPU'}; "
        f"warm-up {args.warmup} epoch(s), median of {args.repeats}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def plot_scaling(done: list[Config], args: argparse.Namespace, axes) -> None:
    sizes = range(1, args.max_procs + 1)
    for workload in [args.model, "mnist"]:
        batch = args.batch_size if workload != "mnist" else args.mnist_batch_size
        for kind in ["weak", "strong", "side by side"]:
            points = [(n, scaling_rate(done, workload, batch, kind, n)) for n in sizes]
            points = [(n, r) for n, r in points if r]
            if len(points) > 1 and points[0][0] == 1:
                speedup = [r / points[0][1] for _, r in points]
                axes.plot([n for n, _ in points], speedup, "o-", label=f"{workload} {kind}")
    axes.plot([1, args.max_procs], [1, args.max_procs], "k--", label="ideal")
    axes.set(xlabel="ranks (1 thread each, torchrun)", ylabel="speed-up vs 1 rank")
    axes.set_title("scaling")
    axes.legend()


def ensure_mnist(args: argparse.Namespace, configs: list[Config]) -> None:
    if not any(c.workload == "mnist" for c in configs):
        return
    if not (Path(args.mnist_data) / "MNIST" / "raw").is_dir():
        writer = REPO / "exercises" / "get_mnist_subset.py"
        subprocess.run([sys.executable, str(writer), args.mnist_data], check=True)


def run(configs: list[Config], args: argparse.Namespace) -> bool:
    """Each launch in turn, then the outputs, written whatever happened: launches that failed
    or timed out are rows with that status; after Ctrl-C or a kill (SIGTERM), the launches not
    measured are rows "not run". True if it was interrupted."""
    load = f"{os.getloadavg()[0]:.1f}"
    log(
        f"{len(configs)} launches, {bound_s(configs):.0f} s at most (each within its timeout); "
        f"{CORES} cores; load average {load}; srun: {srun_usable()}"
    )
    try:
        for config in tqdm(configs, desc="benchmark", unit="launch"):
            # what the row says if Ctrl-C or a kill ends this launch
            config.result = {"status": "interrupted", "samples_per_s": ""}
            config.result = measure(config, args)
            got = config.result["samples_per_s"] or config.result["status"]
            epochs, wall = config.result["timed_epochs"], config.result["wall_s"]
            log(f"{config.label}: {got} samples/s (epochs {epochs}, {wall} s)")
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
        return True
    finally:
        # a second Ctrl-C or kill would leave the files half written
        previous = [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]
        for config in configs:
            config.result = config.result or {"status": "not run", "samples_per_s": ""}
        lines = ratios(configs, args)
        written = write_outputs(configs, lines, args, f"{load}, {os.getloadavg()[0]:.1f}")
        for what, value, goal in lines:
            log(f"{what}: {value}{verdict(what, value, goal)}")
        log(f"wrote {', '.join(written)} to {args.out}")
        if any(c.ceiling or c.loader for c in configs):
            csv_path = Path(args.out) / "results.csv"
            log(f"each run beside its ceiling and loader: python {SPEED_FIGURE} --from {csv_path}")
        for sig, handler in zip((signal.SIGINT, signal.SIGTERM), previous, strict=True):
            signal.signal(sig, handler)
    return False


def main() -> None:
    # `kill` ends the current launch too, and the outputs are still written
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args = parse_args()
    if args.probe:
        probe(args.probe[0], args.probe[1], args.probe[2:])
        return
    configs = plan(args)
    ensure_mnist(args, configs)
    if run(configs, args):
        sys.exit(130)
    if any(c.result["status"] != "ok" for c in configs):
        sys.exit("error: some launches failed or timed out: see above")


if __name__ == "__main__":
    main()
