"""The benchmark (part4_torchrun/tools/benchmark.py) in its smoke mode: two tiny launches of the
real scripts, then a well-formed CSV, plot and summary. It checks the pipeline, never a speed."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, launch
from course_steps import PART1, STEP6

COLUMNS = [
    *("suite", "label", "workload", "script", "launcher", "world_size", "threads"),
    *("threads_seen", "batch_per_process", "global_batch", "flags", "samples_per_s"),
    *("timed_epochs", "gpu_util_pct", "status", "wall_s", "copies"),
]
BENCHMARK = REPO / "part4_torchrun" / "tools" / "benchmark.py"


def test_benchmark_smoke_writes_csv_plot_and_ratios(tmp_path: Path) -> None:
    command = [PYTHON, "part4_torchrun/tools/benchmark.py", "--smoke", "--out", str(tmp_path)]
    run = launch(command, timeout=180)
    with (tmp_path / "results.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == COLUMNS
    assert [(r["script"], r["launcher"], r["world_size"]) for r in rows] == [
        (PART1, "python", "1"),
        (STEP6, "python", "1"),
    ]
    for r in rows:
        assert r["status"] == "ok", r
        epochs = [float(x) for x in r["timed_epochs"].split(";")]
        assert len(epochs) == 1 and epochs[0] > 0
        assert float(r["samples_per_s"]) == pytest.approx(epochs[0])
        # read from the script's own "threads=" line
        assert r["threads_seen"].isdigit(), r
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "overhead at n=1: part4 python n=1 vs part1" in run.stderr + run.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert "| part4 python n=1 |" in summary
    # the summary says how it was made: the command and the machine
    assert "benchmark.py --smoke" in summary and "CPU cores" in summary


def test_verdicts_claim_only_what_the_runs_support() -> None:
    """A ratio is judged against its goal; one that only a changed load explains (a negative
    overhead, a weak-scaling efficiency above 100%) says so instead, and a ratio without a goal
    gets no verdict (no error)."""
    spec = importlib.util.spec_from_file_location("benchmark", BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    sys.modules["benchmark"] = benchmark  # dataclasses look their module up while it loads
    spec.loader.exec_module(benchmark)
    verdict = benchmark.verdict
    overhead, weak = "overhead at n=1: part4 vs part1", "mnist n=2 weak scaling vs n=1"
    assert verdict(overhead, "3.0%", "<= 5%") == " (goal <= 5%: met)"
    assert verdict(overhead, "7.5%", "<= 5%") == " (goal <= 5%: NOT met)"
    assert "within noise" in verdict(overhead, "-844.6%", "<= 5%")
    assert verdict(weak, "72%", ">= 85%") == " (goal >= 85%: NOT met)"
    assert "measure again" in verdict(weak, "279%", ">= 85%")
    assert verdict("mnist n=2 strong scaling vs n=1", "79%", "") == ""
    assert verdict(weak, "n/a", ">= 85%") == ""
