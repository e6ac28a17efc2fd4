"""The benchmark (part4_torchrun/tools/benchmark.py): its smoke mode, four tiny launches of the real
scripts (part 1, part 4, and part 4's ceiling and loader alone), then a well-formed CSV, plot and
summary; its outputs when launches fail, time out or are interrupted; the GPU plan and its bound.
It checks the pipeline, never a speed."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path
from types import ModuleType

import pytest
from conftest import PYTHON, REPO, import_script, launch, png_size
from course_steps import PART1, STEP6

COLUMNS = [
    *("suite", "label", "workload", "script", "launcher", "world_size", "threads"),
    *("threads_seen", "batch_per_process", "global_batch", "flags", "samples_per_s"),
    *("timed_epochs", "gpu_util_pct", "status", "wall_s", "copies", "timeout_s"),
    *("ceiling_samples_per_s", "pct_of_ceiling", "loader_samples_per_s", "loader_batches_per_s"),
    "bound_by",
]
BENCHMARK = REPO / "part4_torchrun" / "tools" / "benchmark.py"
SPEED_README = REPO / "part4_torchrun" / "speed" / "README.md"
SPEED_FIGURE = REPO / "part4_torchrun" / "speed" / "figures" / "draw_speed.py"
# the CPU run the speed chapter shows (its README's first benchmark command)
CPU_RESULTS = REPO / "part4_torchrun" / "tools" / "benchmark_cpu" / "results.csv"


def load(name: str, path: Path) -> ModuleType:
    return import_script(path, name)


def load_benchmark() -> ModuleType:
    return load("benchmark", BENCHMARK)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        return list(reader)


def test_benchmark_smoke_writes_csv_plot_and_ratios(tmp_path: Path) -> None:
    command = [PYTHON, "part4_torchrun/tools/benchmark.py", "--smoke", "--out", str(tmp_path)]
    run = launch(command, timeout=240)
    rows = read_csv(tmp_path / "results.csv")
    assert [(r["suite"], r["script"], r["launcher"], r["world_size"]) for r in rows] == [
        ("parts", PART1, "python", "1"),
        ("parts", STEP6, "python", "1"),
        ("ceiling", STEP6, "python", "1"),
        ("loader", STEP6, "python", "1"),
    ]
    for r in rows:
        assert r["status"] == "ok", r
        epochs = [float(x) for x in r["timed_epochs"].split(";")]
        assert len(epochs) == 1 and epochs[0] > 0
        assert float(r["samples_per_s"]) == pytest.approx(epochs[0])
        # read from the script's own "threads=" line
        assert r["threads_seen"].isdigit(), r
    # part 4's run against its ceiling and its loader alone
    part4, ceiling, loader = rows[1:]
    assert float(part4["ceiling_samples_per_s"]) == float(ceiling["samples_per_s"])
    share = 100 * float(part4["samples_per_s"]) / float(ceiling["samples_per_s"])
    assert float(part4["pct_of_ceiling"]) == pytest.approx(share, abs=0.1)
    assert float(part4["loader_samples_per_s"]) == float(loader["samples_per_s"])
    batches = float(loader["samples_per_s"]) / int(loader["batch_per_process"])
    assert float(part4["loader_batches_per_s"]) == pytest.approx(batches, abs=0.01)
    slower = (
        "loader" if float(loader["samples_per_s"]) < float(ceiling["samples_per_s"]) else "model"
    )
    assert part4["bound_by"] == slower
    assert png_size(tmp_path / "results.png")[0] > 0, "the parts suite's picture"
    assert "overhead at n=1: part4 python n=1 vs part1" in run.stderr + run.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert "| part4 python n=1 |" in summary
    assert f"- part4 python n=1: the {slower} bounds it" in summary
    # the summary says how it was made: the command and the machine
    assert "benchmark.py --smoke" in summary and "CPU cores" in summary
    # The speed figure on this run's results.csv: the run, its ceiling and its loader alone as
    # the CSV has them, the slower of the two alone named as the bound; drawn to 900 px.
    assert f"draw_speed.py --from {tmp_path / 'results.csv'}" in run.stderr + run.stdout
    figure = load("draw_speed", SPEED_FIGURE)
    data = figure.parse((tmp_path / "results.csv").read_text())
    assert data["title"] == "CPU, no GPU: test_resnet, 8 images a batch, 1 process", data
    assert data["runs"] == [
        {
            "label": "part4 python n=1",
            "samples_per_s": float(part4["samples_per_s"]),
            "ceiling": float(ceiling["samples_per_s"]),
            "loader": float(loader["samples_per_s"]),
            "bound": slower,
        }
    ]
    figure.draw([data, data], tmp_path / "speed.png")  # a CPU's panel and, later, a GPU's
    width, height = png_size(tmp_path / "speed.png")
    assert width == 900 and height <= 550, (width, height)


def test_the_speed_figure_shows_the_cpu_run_of_the_speed_chapter() -> None:
    """What the speed chapter's figure and its caption say of the committed CPU run: every
    flags row of a CPU, each with its ceiling and its loader alone; the model bounds every one
    (its loader alone is faster than its step alone); the PNG drawn from it, 900 px wide."""
    figure = load("draw_speed", SPEED_FIGURE)
    data = figure.parse(CPU_RESULTS.read_text())
    assert data["title"].startswith("CPU, no GPU: resnet18, 16 images a batch"), data
    runs = data["runs"]
    assert [r["label"] for r in runs] == list(load_benchmark().CPU_FLAG_RUNS)
    assert all(r["samples_per_s"] and r["ceiling"] and r["loader"] for r in runs), runs
    assert all(r["bound"] == "model" and r["loader"] > r["ceiling"] for r in runs), runs
    assert png_size(SPEED_FIGURE.with_name("speed.png")) == (900, 429)


def test_failed_timed_out_and_interrupted_launches_are_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch that fails is a row "failed: <its error line>", one that outlives its timeout a
    row "timed out"; a run interrupted (Ctrl-C, kill) writes its files all the same: the launch
    it ended "interrupted", those it did not reach "not run". No training runs: Python fails at
    once on a script that does not exist, the timed-out launch sleeps, and the interrupt is raised
    in place of a launch."""
    benchmark = load_benchmark()
    args = benchmark.parse_args(["--suites", "flags", "--out", str(tmp_path)])

    def config(label: str, script: str, timeout: float):
        where = ("resnet18", script, "python", 1, "default", 16)
        return benchmark.Config("flags", label, *where, timeout=timeout)

    missing = config("missing", "part4_torchrun/speed/no_such_step.py", 60)
    sleeping = config("sleeping", "sleep.py", 0.5)
    interrupted = config("interrupted", "interrupted.py", 60)
    unreached = config("unreached", "unreached.py", 60)
    measure, command = benchmark.measure, benchmark.command

    def sleep_command(c, args):
        if c is sleeping:
            return [PYTHON, "-c", "import time; time.sleep(60)"]
        return command(c, args)

    def measure_until_interrupted(c, args):
        if c is interrupted:
            raise KeyboardInterrupt
        return measure(c, args)

    monkeypatch.setattr(benchmark, "command", sleep_command)
    monkeypatch.setattr(benchmark, "measure", measure_until_interrupted)
    assert benchmark.run([missing, sleeping, interrupted, unreached], args) is True
    rows = {r["label"]: r for r in read_csv(tmp_path / "results.csv")}
    assert rows["missing"]["status"].startswith("failed: ")
    assert "no_such_step.py" in rows["missing"]["status"]
    assert "\n" not in rows["missing"]["status"]
    assert rows["sleeping"]["status"] == "timed out"
    assert float(rows["sleeping"]["wall_s"]) < 10
    assert rows["interrupted"]["status"] == "interrupted"
    assert rows["unreached"]["status"] == "not run"
    summary = (tmp_path / "summary.md").read_text()
    assert "| sleeping | python | 1 | default (?) | 16 | timed out |" in summary
    assert "| unreached | python | 1 | default (?) | 16 | not run |" in summary
    # the flags suite's picture is the speed chapter's figure, drawn from results.csv
    assert not (tmp_path / "results.png").exists()


def gpu_command() -> list[str]:
    """The speed README's command for one GPU, as arguments of benchmark.py."""
    lines = [
        line
        for line in SPEED_README.read_text().splitlines()
        if line.startswith("python part4_torchrun/tools/benchmark.py") and "256" in line
    ]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0].split("#")[0])
    return words[2:]


def test_the_gpu_command_plans_its_rows_within_3_minutes() -> None:
    """On a GPU (planned here without one) the README's command runs the rows that say whether
    the loader or the model bounds speed 3 and speed 4, each launch within its timeout, all of
    them within 3 minutes with a margin for the benchmark's own start and its files."""
    benchmark = load_benchmark()
    args = benchmark.parse_args(gpu_command())
    configs = benchmark.plan(args, gpu=True)
    runs = [c for c in configs if not c.probe]
    assert [c.label for c in runs] == list(benchmark.GPU_FLAG_RUNS)
    assert all(c.ceiling in configs and c.loader in configs for c in runs)
    assert all(c.timeout == benchmark.GPU_TIMEOUT_S["--compile" in c.flags] for c in configs)
    assert benchmark.bound_s(configs) <= 170
    # every flags row on a CPU, each with its ceiling and loader alone, none measured twice
    cpu = benchmark.plan(args, gpu=False)
    assert [c.label for c in cpu if not c.probe] == list(benchmark.CPU_FLAG_RUNS)
    assert len({c.key() for c in cpu}) == len(cpu)
    assert all(c.timeout == benchmark.CPU_TIMEOUT_S for c in cpu)


def test_verdicts_claim_only_what_the_runs_support() -> None:
    """A ratio is judged against its goal; one that only a changed load explains (a negative
    overhead, a weak-scaling efficiency above 100%) says so instead, and a ratio without a goal
    gets no verdict (no error)."""
    verdict = load_benchmark().verdict
    overhead, weak = "overhead at n=1: part4 vs part1", "mnist n=2 weak scaling vs n=1"
    assert verdict(overhead, "3.0%", "<= 5%") == " (goal <= 5%: met)"
    assert verdict(overhead, "7.5%", "<= 5%") == " (goal <= 5%: NOT met)"
    assert "within noise" in verdict(overhead, "-844.6%", "<= 5%")
    assert verdict(weak, "72%", ">= 85%") == " (goal >= 85%: NOT met)"
    assert "measure again" in verdict(weak, "279%", ">= 85%")
    assert verdict("mnist n=2 strong scaling vs n=1", "79%", "") == ""
    assert verdict(weak, "n/a", ">= 85%") == ""
