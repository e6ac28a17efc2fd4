"""Beyond DDP (part4_torchrun/beyond_ddp/): each step's claim, asserted on its real output under
torchrun, on CPU ranks with gloo. Few launches, many asserts per launch; the diff contract and
the README checks of the other test files, applied to this chapter."""

from __future__ import annotations

import ast
import math
import re
import shutil
from pathlib import Path

import pytest
import test_diff_contract
import test_readme
from conftest import PYTHON, REPO, TINY_RUN, TORCHRUN, Run, launch
from course_steps import STEP6, Step
from test_inside_ddp import assert_only_lines, records

FOLDER = "part4_torchrun/beyond_ddp"
README = Path(FOLDER) / "README.md"
# Seconds per launch; healthy ones take 3-10 s here.
TIMEOUT = 180
# Each step's diff against the one before: the APIs it teaches, its tag, and a ceiling on its
# changed lines (the measured size; lower it when a diff shrinks).
STEPS = [
    Step(
        "beyond 2",
        f"{FOLDER}/step2_buckets.py",
        f"{FOLDER}/step1_by_hand.py",
        "by hand 2",
        "torchrun",
        "gradient hooks, buckets, asynchronous all-reduce",
        (
            *("register_post_accumulate_grad_hook", "async_op=True", "Buckets("),
            *("buckets.wait()", "buckets.remove()", "--bucket-mb"),
        ),
        69,
    ),
    Step(
        "beyond 3",
        f"{FOLDER}/step3_zero1.py",
        f"{FOLDER}/step2_buckets.py",
        "by hand 3",
        "torchrun",
        "ZeRO-1: optimizer state sharded",
        ("all_gather_into_tensor(",),
        27,
    ),
    Step(
        "beyond 4",
        f"{FOLDER}/step4_fsdp2.py",
        STEP6,
        "FSDP2",
        "torchrun",
        "fully_shard, full and sharded checkpoints",
        (
            *("fully_shard(", "init_device_mesh(", "dcp.save(", "dcp.load("),
            *("get_model_state_dict", "--sharded"),
        ),
        92,
    ),
]


def torchrun(script: str, *args: str, nprocs: int = 2) -> Run:
    command = [TORCHRUN, "--standalone", f"--nproc_per_node={nprocs}", f"{FOLDER}/{script}"]
    return launch([*command, *args], timeout=TIMEOUT)


def one(run: Run, kind: str) -> dict[str, str]:
    (fields,) = records(run, kind)
    return fields


def comparisons(run: Run) -> dict[str, str]:
    """The two `compare` lines of steps 1-3, merged."""
    return {k: v for r in records(run, "compare") for k, v in r.items()}


def assert_state_ratio(run: Run, world_size: int, expected: float, tolerance: float) -> None:
    """Every rank's optimizer state, by hand / DDP's, is `expected` within `tolerance`."""
    rows = records(run, "optimizer_state")
    assert [r["rank"] for r in rows] == [str(k) for k in range(world_size)], rows
    for r in rows:
        ratio = int(r["by_hand_bytes"]) / int(r["ddp_bytes"])
        assert abs(ratio - expected) <= tolerance, (r, expected)


STEP_LINES = ("model", "by_hand", "ddp", "compare", "optimizer_state")


def test_by_hand_and_bucketed_ddp_equal_real_ddp_bit_for_bit() -> None:
    # Steps 1 and 2 on 2 ranks, 20 Adam steps each: each trains a DDP copy beside its own.
    naive, bucketed = torchrun("step1_by_hand.py"), torchrun("step2_buckets.py")
    for run in (naive, bucketed):
        assert_only_lines(run, *STEP_LINES)
        assert one(run, "model")["world_size"] == "2"
        compare = comparisons(run)
        # Two ranks: a + b has one order, and halving is exact, so nothing can differ.
        assert compare["max_abs_diff"] == "0.000e+00" and compare["bit_equal"] == "True"
        assert one(run, "by_hand")["sha"] == one(run, "ddp")["sha"]
        assert compare["ranks_in_sync"] == "True", "every rank holds the same weights"
        assert float(one(run, "by_hand")["loss"]) < math.log(10), "it learns (chance: ln 10)"
        assert_state_ratio(run, 2, expected=1.0, tolerance=0)
    # Buckets and hooks change when the sums are sent, not what they are.
    assert one(bucketed, "by_hand")["sha"] == one(naive, "by_hand")["sha"]


def test_zero1_keeps_a_third_of_adam_on_3_ranks_within_tolerance_of_ddp() -> None:
    # Step 3 on 3 ranks (the notebook runs it on 2, where it is bit-equal to DDP).
    run = torchrun("step3_zero1.py", nprocs=3)
    assert_only_lines(run, *STEP_LINES)
    compare = comparisons(run)
    # Three ranks: gloo adds three numbers in an order that depends on where they sit in the
    # message, and DDP's buckets are laid out otherwise: ~1e-7 apart, stated bound 1e-5.
    assert 0 < float(compare["max_abs_diff"]) < 1e-5, compare
    assert compare["bit_equal"] == "False"
    assert compare["ranks_in_sync"] == "True", "the all-gather gives every rank every shard"
    # Adam's moments of one shard: 1/3 of DDP's, to the padding of at most 2 parameters.
    assert_state_ratio(run, 3, expected=1 / 3, tolerance=1e-4)


def test_overlap_bench_prints_a_ratio_for_each_bucket_size() -> None:
    # A smoke run on a tiny model: the README's figures come from the full-size command.
    sizes = ["0.01", "0.05", "1"]
    args = ["--sizes", ",".join(sizes), "--steps", "2", "--width", "64", "--depth", "3"]
    run = torchrun("overlap_bench.py", *args)
    assert_only_lines(run, "machine", "bench")
    machine = one(run, "machine")
    assert machine["backend"] == "gloo" and machine["world_size"] == "2", machine
    rows = records(run, "bench")
    assert [r["bucket_mb"] for r in rows] == sizes
    counts = [int(r["buckets"]) for r in rows]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1, "bigger, fewer buckets"
    for r in rows:
        after, overlap = float(r["after_ms"]), float(r["overlap_ms"])
        assert min(after, overlap, float(r["compute_ms"])) > 0
        # printed from unrounded times: the rounded ones give it to about 1%
        assert float(r["speedup"]) == pytest.approx(after / overlap, rel=0.01, abs=1e-3)
        assert re.fullmatch(r"-?\d+%|n/a", r["hidden"]), r


def function_source(path: str, name: str) -> str:
    tree = ast.parse((REPO / path).read_text())
    (function,) = [n for n in tree.body if getattr(n, "name", None) == name]
    return ast.unparse(function)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """A: step 4 on 2 ranks, 2 epochs, a sharded checkpoint per epoch, then the whole weights
    (a.pt). The FSDP2 test and the memory notebook both read it."""
    folder = tmp_path_factory.mktemp("fsdp2")
    args = [*TINY_RUN, "--epochs", "2", "--sharded", str(folder / "sharded")]
    return torchrun("step4_fsdp2.py", *args, "--checkpoint", str(folder / "a.pt")), folder


def test_fsdp2_trains_as_ddp_and_its_checkpoints_reload(fsdp2: tuple[Run, Path]) -> None:
    import torch

    a, folder = fsdp2
    sharded, out = folder / "sharded", {n: str(folder / f"{n}.pt") for n in "adbc"}
    step4 = f"{FOLDER}/step4_fsdp2.py"
    fsdp = [*TINY_RUN, "--epochs", "2", "--sharded", str(sharded)]
    # D: part 4's DDP script, the same run as A.
    ddp = [TORCHRUN, "--standalone", "--nproc_per_node=2", STEP6, *TINY_RUN, "--epochs", "2"]
    d = launch([*ddp, "--checkpoint", out["d"]], timeout=TIMEOUT)
    weights = {n: torch.load(out[n], weights_only=True) for n in "ad"}

    def equal(name: str) -> bool:
        other = torch.load(out[name], weights_only=True)
        return other.keys() == weights["a"].keys() and all(
            torch.equal(other[k], weights["a"][k]) for k in other
        )

    # fully_shard instead of DDP trains the same model: the same losses, bit-equal weights
    # (BatchNorm statistics included: rank 0's, as DDP keeps them).
    train = ("train_loss", "train_acc", "train_samples")
    assert [[e[k] for k in train] for e in a.epochs()] == [
        [e[k] for k in train] for e in d.epochs()
    ]
    assert equal("d"), "FSDP2's whole weights equal DDP's"
    # Every rank scores as many test images (24 of 25): FSDP's forward is a collective.
    assert [e["test_samples"] for e in a.epochs()] == [24, 24]
    # The whole state dict loads into a bare model, every key matched, built by part 1's own
    # build_model: the single-device course model.
    assert f"checkpoint {out['a']} loads into a bare test_resnet" in a.stdout
    assert function_source(step4, "build_model") == function_source(
        "part1_single/train.py", "build_model"
    )
    # Each rank holds half of every weight, gradient and momentum: its local shards.
    memory = {r["rank"]: r for r in records(a, "memory")}
    assert sorted(memory) == ["0", "1"]
    whole = sum(int(row["params_bytes"]) for row in memory.values())
    for row in memory.values():
        for kind in ("params", "grads", "optimizer"):
            assert abs(int(row[f"{kind}_bytes"]) / whole - 0.5) < 0.02, row
    # One sharded checkpoint per epoch, one file per rank, the .metadata written last.
    for epoch in ("epoch_1", "epoch_2"):
        files = sorted(p.name for p in (sharded / epoch).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files

    # B: plain python, a world of one, resumes from the newest (epoch 2: nothing left to train)
    # and gathers the weights: the 2-rank shards resharded onto 1 rank, bit for bit.
    b = launch([PYTHON, step4, *fsdp, "--checkpoint", out["b"]], timeout=TIMEOUT)
    assert f"resumed from {sharded / 'epoch_2'} on 1 rank(s)" in b.stdout
    assert not b.epochs() and equal("b")
    # One rank holds every weight: the 2 ranks' shards added up to the whole, no more.
    assert one(b, "memory")["params_bytes"] == str(whole)

    # C: 2 ranks again, from epoch 1 (epoch 2's folder gone): epoch 2 trained again gives
    # A's epoch 2 and A's weights, bit for bit (optimizer and schedule restored; epochs reseed).
    shutil.rmtree(sharded / "epoch_2")
    c = torchrun("step4_fsdp2.py", *fsdp, "--checkpoint", out["c"])
    assert f"resumed from {sharded / 'epoch_1'} on 2 rank(s)" in c.stdout
    assert [e["epoch"] for e in c.epochs()] == [2]
    assert c.epochs()[0]["train_loss"] == a.epochs()[1]["train_loss"]
    assert equal("c"), "resumed on 2 ranks: the uninterrupted run's weights"

    # A checkpoint of another model stops the run in one line, on each rank.
    wrong = [*fsdp, "--model", "resnet10t", "--checkpoint", ""]
    bad = launch([PYTHON, step4, *wrong], timeout=TIMEOUT, check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.describe()
    assert bad.stderr.strip().startswith(f"error: cannot resume from {sharded / 'epoch_2'}: ")


@pytest.mark.slow
def test_memory_notebook_checks_its_predictions(
    fsdp2: tuple[Run, Path], run_notebook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The notebook asserts each prediction itself; here its printed checks are counted and read
    # again. It reads step 4's output from the FSDP2 run (the costly launch) and launches
    # step 3 on 2 ranks itself, saving its output beside.
    (tmp_path / "step4_fsdp2.log").write_text(fsdp2[0].stdout)
    monkeypatch.setenv("BEYOND_DDP_LOGS", str(tmp_path))
    path = REPO / FOLDER / "memory.ipynb"
    notebook = run_notebook(path, cwd=path.parent)
    assert "bit_equal=True" in (tmp_path / "step3_zero1.log").read_text()
    text = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    lines = [line for line in text.splitlines() if line.startswith("check ")]
    kinds = [line.split()[1] for line in lines]
    assert (kinds.count("zero1"), kinds.count("fsdp2"), kinds.count("mixed")) == (4, 6, 4)
    for check in (dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines):
        predicted, measured = float(check["predicted"]), float(check["measured"])
        assert measured == pytest.approx(predicted, rel=0.02), check


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.label)
def test_each_diff_shows_its_step_within_budget(step: Step) -> None:
    test_diff_contract.test_each_diff_shows_its_step_and_nothing_else(step)
    test_diff_contract.test_teaching_scripts_are_standalone_and_short(step)


def test_readme_names_real_files_flags_and_diff_lines() -> None:
    test_readme.test_named_files_and_links_exist(README)
    test_readme.test_command_flags_exist(README)
    test_readme.test_diff_excerpts_match_the_scripts(README)

    def docstring(path: str) -> str | None:
        return ast.get_docstring(ast.parse((REPO / path).read_text()))

    # Steps 1-3 share one docstring, step 4 the course's: every diff opens on code.
    by_hand = {docstring(s.before) for s in STEPS[:2]} | {docstring(STEPS[1].script)}
    assert len(by_hand) == 1 and docstring(STEPS[2].script) == docstring(STEP6)
