"""Beyond DDP (part4_torchrun/beyond_ddp/): each step's claim, asserted on its real output under
torchrun, on CPU ranks with gloo. Starting Python and importing torch is most of a launch's cost,
so each launch runs several steps in turn (tests/run_in_turn.py) and every claim of a step is
asserted on its part of the output. The diff contract of the chapter's steps is checked with the
course's (tests/test_diff_contract.py, tests/course_steps.py: BEYOND_STEPS), its README by
tests/test_readme.py."""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import Path

import pytest
from conftest import (
    PYTHON,
    REPO,
    TINY_RUN,
    TORCHRUN,
    TORCHRUN_2,
    Run,
    assert_figure,
    import_script,
    launch,
    png_size,
)
from course_steps import (
    BEYOND,
    BY_HAND1,
    BY_HAND2,
    BY_HAND3,
    FSDP2,
    FSDP2_DCP,
    FSDP2_MEMORY,
    PART1,
    STEP6,
    ZERO1,
)
from test_inside_ddp import assert_only_lines, records

# Seconds per launch; healthy ones take 10-40 s here, under load.
TIMEOUT = 300
IN_TURN = "tests/run_in_turn.py"
BY_HAND_LINES = ("model", "buckets", "by_hand", "ddp", "compare", "optimizer_state")
# The model people train: a frozen layer, a layer used twice, BatchNorm's buffers; each rank
# starts from its own seed. With each optimizer of the list, ZeRO-1 trains it as DDP does:
# SGD with momentum and AdamW work element by element, Adafactor keeps per-tensor statistics.
MIXED = ["--model", "mixed"]
ZERO1_OPTIMIZERS = ("SGD", "AdamW", "Adafactor")
# The drop-ins (by_hand.py), case by case against torch's classes; part 4's training with them.
DROP_IN_CASES = "tests/beyond_drop_in_cases.py"
DROP_IN = f"{BEYOND}/step8_drop_in.py"
BY_HAND_FLAGS = ["--by-hand-ddp", "--zero1"]
OVERLAP_FIGURE = f"{BEYOND}/figures/draw_overlap.py"
MEMORY_FIGURE = f"{BEYOND}/figures/draw_memory.py"


def in_turn(*runs: list[str], nprocs: int = 2, check: bool = True) -> list[Run]:
    """Each run ([script, *args]) in turn, in one launch: torchrun with `nprocs` ranks, or plain
    python for 0. Returns one Run per script: the launch's, with that script's stdout alone."""
    words = [w for run in runs for w in ("---", *run)][1:]
    launcher = [TORCHRUN, "--standalone", f"--nproc_per_node={nprocs}"] if nprocs else [PYTHON]
    done = launch([*launcher, IN_TURN, *words], timeout=TIMEOUT, check=check)
    # Each rank opens a script's output with `script NAME`; no rank starts the next before all
    # have ended this one, but a rank may print before another has opened: a turn is counted by
    # its `script` lines, one per rank.
    per_turn = nprocs or 1
    turns: list[list[str]] = [[] for _ in runs]
    opened = 0
    for line in done.stdout.splitlines():
        if line.startswith("script "):
            opened += 1
        else:
            turns[max(opened - 1, 0) // per_turn].append(line)
    assert opened == len(runs) * per_turn, done.describe()
    return [Run(done.command, done.returncode, "\n".join(t) + "\n", done.stderr) for t in turns]


def one(run: Run, kind: str) -> dict[str, str]:
    (fields,) = records(run, kind)
    return fields


def assert_by_hand_equals_ddp(
    run: Run,
    world_size: int,
    state_ratio: float | None,
    learns: bool = True,
    tolerance: float = 1e-5,
) -> None:
    """Steps 1 to 4: DDP trained beside; every rank in sync, weights and buffers; the optimizer's
    state per rank, by hand over DDP's, `state_ratio` (None: ZeRO-1, each rank keeping the state
    of the whole parameters it owns, the ranks' shares adding up to DDP's). On 3 ranks the
    weights differ by less than `tolerance`."""
    assert_only_lines(run, *BY_HAND_LINES)
    assert one(run, "model")["world_size"] == str(world_size)
    compare = {k: v for r in records(run, "compare") for k, v in r.items()}
    assert compare["ranks_in_sync"] == "True", "every rank holds the same weights"
    if world_size == 2:
        # Two ranks: a + b has one order, and halving is exact: nothing can differ.
        assert compare["bit_equal"] == "True" and compare["max_abs_diff"] == "0.000e+00"
        assert one(run, "by_hand")["sha"] == one(run, "ddp")["sha"]
    else:
        # Three ranks: sums in another order than DDP's buckets, gradients a few ulps apart.
        diff = float(compare["max_abs_diff"])
        assert compare["bit_equal"] == "False" and 0 < diff < tolerance, (diff, tolerance)
    if learns:
        assert float(one(run, "by_hand")["loss"]) < math.log(10), "it learns (chance: ln 10)"
    rows = records(run, "optimizer_state")
    assert [r["rank"] for r in rows] == [str(k) for k in range(world_size)], rows
    ratios = [int(r["by_hand_bytes"]) / int(r["ddp_bytes"]) for r in rows]
    if state_ratio is None:
        assert sum(ratios) == pytest.approx(1, abs=1e-9) and max(ratios) < 1, rows
    else:
        assert all(abs(ratio - state_ratio) <= 1e-4 for ratio in ratios), (rows, state_ratio)


@pytest.fixture(scope="module")
def by_hand() -> list[Run]:
    """On 2 ranks: steps 1 to 4 (20 Adam steps each), a smoke run of the overlap benchmark with
    its timeline, steps 1 to 4 on the mixed model, then step 4 on it with each of
    ZERO1_OPTIMIZERS; last, the drop-ins' cases against torch's classes."""
    bench = ["--sizes", "0.01,0.05,1", "--steps", "2", "--width", "64", "--depth", "3"]
    scripts = (BY_HAND1, BY_HAND2, BY_HAND3, ZERO1)
    mixed = [[script, *MIXED] for script in scripts]
    optimizers = [[ZERO1, *MIXED, "--optimizer", name] for name in ZERO1_OPTIMIZERS]
    steps = [[script] for script in scripts]
    timeline = [f"{BEYOND}/overlap_bench.py", *bench, "--timeline"]
    return in_turn(*steps, timeline, *mixed, *optimizers, [DROP_IN_CASES])


def test_by_hand_steps_equal_real_ddp_bit_for_bit(by_hand: list[Run]) -> None:
    naive, bucketed, hooked, zero1 = by_hand[:4]
    for run in (naive, bucketed, hooked):
        assert_by_hand_equals_ddp(run, 2, state_ratio=1.0)
    # ZeRO-1: Adam's moments for the whole parameters this rank owns.
    assert_by_hand_equals_ddp(zero1, 2, state_ratio=None)
    # Buckets, hooks and shards change how the sums travel, not what they are.
    shas = {one(run, "by_hand")["sha"] for run in (naive, bucketed, hooked, zero1)}
    assert len(shas) == 1, shas


def test_overlap_bench_prints_a_ratio_for_each_bucket_size(by_hand: list[Run]) -> None:
    # A smoke run on a tiny model: the README's figures come from the full-size command.
    run = by_hand[4]
    assert_only_lines(run, "machine", "bench", "timeline")
    machine = one(run, "machine")
    assert machine["backend"] == "gloo" and machine["world_size"] == "2", machine
    rows = records(run, "bench")
    assert [r["bucket_mb"] for r in rows] == ["0.01", "0.05", "1"]
    counts = [int(r["buckets"]) for r in rows]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1, "bigger, fewer buckets"
    for r in rows:
        after, overlap = float(r["after_ms"]), float(r["overlap_ms"])
        assert min(after, overlap, float(r["compute_ms"])) > 0
        # printed from unrounded times: the rounded ones give it to about 1%
        assert float(r["speedup"]) == pytest.approx(after / overlap, rel=0.01, abs=1e-3)
        assert re.fullmatch(r"-?\d+%|n/a", r["hidden"]), r


def buckets(run: Run) -> tuple[list[int], list[int]]:
    """The bytes of each message a step sends: by hand, then DDP's buckets."""
    row = one(run, "buckets")
    return tuple([int(b) for b in row[k].split(",")] for k in ("by_hand", "ddp"))


def test_by_hand_trains_frozen_tied_batchnorm_model_as_ddp(by_hand: list[Run]) -> None:
    # Each rank from its own seed; the wrapper broadcasts rank 0's weights (the frozen layer's
    # too) and buffers, leaves the frozen layer out, sums the twice-used layer's gradient once,
    # and copies rank 0's BatchNorm statistics as DDP does: weights and buffers bit-equal.
    mixed, optimizers = by_hand[5:9], by_hand[9:12]
    for run in mixed[:3]:
        assert_by_hand_equals_ddp(run, 2, state_ratio=1.0)
    assert_by_hand_equals_ddp(mixed[3], 2, state_ratio=None)
    assert len({one(run, "by_hand")["sha"] for run in mixed}) == 1
    # Frozen parameters travel in neither: 68,874 trainable parameters of 85,514, in fp32.
    assert one(mixed[0], "model")["params"] == "85514"
    for run in mixed:
        assert [sum(sizes) for sizes in buckets(run)] == [68874 * 4] * 2
    # Step 1 sends a message per gradient; from step 2 on, DDP packs 2 buckets, the chapter 3.
    assert len(buckets(mixed[0])[0]) == 6
    assert [len(sizes) for sizes in buckets(mixed[1])] == [3, 2]
    # ZeRO-1 with SGD + momentum, AdamW and Adafactor: each bit-equal to DDP with the same
    # optimizer whole (2 ranks: nothing is summed in another order).
    for run in optimizers:
        assert_by_hand_equals_ddp(run, 2, state_ratio=None, learns=False)
    assert len({one(run, "by_hand")["sha"] for run in optimizers}) == len(ZERO1_OPTIMIZERS)


def test_overlap_figure_step_3_sends_during_backward_step_2_after(
    by_hand: list[Run], tmp_path: Path
) -> None:
    """The timeline figure (figures/draw_overlap.py), parsed and drawn from the benchmark's smoke
    run above: what its caption says holds on every rank. Step 2 starts each bucket's all-reduce
    once backward() has returned; step 3 starts every bucket from the hooks, while backward()
    still runs; both wait for the sums after backward() and step after the wait."""
    figure = import_script(OVERLAP_FIGURE)
    data = figure.parse(by_hand[4].stdout)
    buckets = int(records(by_hand[4], "bench")[0]["buckets"])
    assert buckets > 1
    for variant in ("after", "overlap"):
        assert sorted(data[variant]) == [0, 1], data
        for row in data[variant].values():
            assert len(row["buckets"]) == buckets, row
            order = [row[w] for w in ("forward", "backward", "wait", "step")]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(order)), row
            assert all(start <= end for start, end in row["buckets"]), row
            returned = row["backward"][1]
            starts = [start for start, _ in row["buckets"]]
            if variant == "after":
                assert min(starts) >= returned, ("step 2 sends after backward()", row)
            else:
                assert max(starts) < returned, ("step 3 sends during backward()", row)
    figure.draw(data, tmp_path / "overlap.png")
    committed = Path(OVERLAP_FIGURE).with_name("overlap.png")
    assert_figure(tmp_path / "overlap.png", committed)
    assert png_size(tmp_path / "overlap.png") == png_size(REPO / committed)


# The drop-ins' cases, each against torch's class: ByHandDDP against DistributedDataParallel,
# ZeRO1 against ZeroRedundancyOptimizer (tests/beyond_drop_in_cases.py says what each does).
AGAINST_DDP = ("no_sync", "accumulate", "stray", "keywords", "buckets")
AGAINST_ZERO = ("steplr", "cosine", "groups", "add_param_group", "closure", "save_resume")


def test_drop_ins_do_what_torch_ddp_and_zero_redundancy_optimizer_do(by_hand: list[Run]) -> None:
    run = by_hand[12]
    assert_only_lines(run, "case")
    cases = {case["name"]: case for case in records(run, "case")}
    assert list(cases) == [*AGAINST_DDP, *AGAINST_ZERO, "unconsolidated", "consolidated"]
    for case in cases.values():
        assert "error" not in case, case
    # 2 ranks: a sum of two has one order and halving is exact: every case bit-equal, weights and
    # the last gradients; the closure's losses too, and the whole state on rank 0.
    for name in (*AGAINST_DDP, *AGAINST_ZERO):
        assert cases[name]["weight_diff"] == cases[name]["grad_diff"] == "0.000e+00", cases[name]
    assert cases["closure"]["loss_diff"] == "0.000e+00"
    assert cases["consolidated"]["state_diff"] == "0.000e+00"
    # state_dict() before consolidate_state_dict(): refused in one line, not one rank's shard
    assert cases["unconsolidated"]["refused"] == "True"
    # several tensors in every bucket, more than one bucket; DDP's hold the same elements
    buckets = cases["buckets"]
    per_bucket = [int(n) for n in buckets["tensors_per_bucket"].split(",")]
    assert len(per_bucket) > 1 and min(per_bucket) > 1, buckets
    ddp = [int(n) for n in buckets["ddp_bucket_elements"].split(",")]
    mine = [int(n) for n in buckets["by_hand_bucket_elements"].split(",")]
    assert len(ddp) > 1 and sum(ddp) == sum(mine), buckets


def test_by_hand_on_3_ranks_stays_within_tolerance_and_zero1_shards_its_state() -> None:
    naive, zero1, zero1_sgd = in_turn([BY_HAND1], [ZERO1], [ZERO1, "--optimizer", "SGD"], nprocs=3)
    # Sums in other orders: gradients a few ulps apart. SGD keeps the weights within 1e-5 of
    # DDP's (measured: 1e-8); Adam divides each gradient by its running size, so that a gradient
    # near zero can step its weight by up to about lr either way: within 20 steps x lr (1e-3).
    assert_by_hand_equals_ddp(naive, 3, state_ratio=1.0, tolerance=20 * 1e-3)
    assert_by_hand_equals_ddp(zero1, 3, state_ratio=None, tolerance=20 * 1e-3)
    assert_by_hand_equals_ddp(zero1_sgd, 3, state_ratio=None, learns=False)


def function_source(path: str, name: str) -> str:
    tree = ast.parse((REPO / path).read_text())
    (function,) = [n for n in tree.body if getattr(n, "name", None) == name]
    return ast.unparse(function)


@pytest.fixture(scope="module")
def drop_in_crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """Step 8 with both drop-ins on 2 ranks, 2 epochs, a snapshot after each; the probe kills
    rank 0 as it renames the second one into place, as a crash would, so that epoch 1's stays:
    the run to resume. Its own launch: a crash ends the processes that would run the rest."""
    folder = tmp_path_factory.mktemp("drop_in")
    (folder / "probe").mkdir()
    command = [*TORCHRUN_2, DROP_IN, *TINY_RUN, "--epochs", "2", *BY_HAND_FLAGS]
    command += ["--snapshot", str(folder / "snapshot.pt"), "--checkpoint", ""]
    crash = {"DDP_PROBE_CRASH_AT_REPLACE": "2"}
    run = launch(command, timeout=TIMEOUT, env=crash, probe_dir=folder / "probe", check=False)
    return run, folder / "snapshot.pt"


@pytest.fixture(scope="module")
def fsdp2(
    tmp_path_factory: pytest.TempPathFactory, drop_in_crashed: tuple[Run, Path]
) -> tuple[dict[str, Run], Path]:
    """On 2 ranks, 2 epochs each: D, part 4's DDP train.py; A, step 5; M, step 6 (1 epoch);
    E, step 7 with a sharded checkpoint per epoch; C, step 7 resumed from E's epoch 1; R, step 8
    with both drop-ins resumed from the crashed run's snapshot; P, step 8 without them (DDP, 1
    epoch). Each saves its whole weights in NAME.pt."""
    folder = tmp_path_factory.mktemp("fsdp2")
    sharded = folder / "sharded"
    _, snapshot = drop_in_crashed

    def run(name: str, script: str, epochs: int, *args: str) -> list[str]:
        checkpoint = ["--checkpoint", str(folder / f"{name}.pt")]
        return [script, *TINY_RUN, "--epochs", str(epochs), *checkpoint, *args]

    d, a, m, e, c, r, p = in_turn(
        run("d", STEP6, 2),
        run("a", FSDP2, 2),
        run("m", FSDP2_MEMORY, 1),
        run("e", FSDP2_DCP, 2, "--sharded", str(sharded)),
        run("c", FSDP2_DCP, 2, "--resume", str(sharded / "epoch_1")),
        run("r", DROP_IN, 2, "--snapshot", str(snapshot), *BY_HAND_FLAGS),
        run("p", DROP_IN, 1, "--snapshot", str(folder / "p_snapshot.pt")),
    )
    return dict(d=d, a=a, m=m, e=e, c=c, r=r, p=p), folder


def equal_weights(folder: Path, name: str, other: str = "d") -> bool:
    """NAME.pt and OTHER.pt (part 4's DDP train.py's) hold the same tensors, bit for bit."""
    import torch

    a, b = (torch.load(folder / f"{n}.pt", weights_only=True) for n in (name, other))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


PRINTED = ("train_loss", "train_acc", "train_samples", "test_acc", "test_samples")


def printed(run: Run) -> list[list[float]]:
    """What the epoch lines say of the training, to the printed digit (not the times)."""
    return [[epoch[k] for k in PRINTED] for epoch in run.epochs()]


def test_fsdp2_steps_train_as_ddp_and_their_checkpoints_reload(
    fsdp2: tuple[dict[str, Run], Path],
) -> None:
    out, folder = fsdp2

    def equal_to_ddp(name: str) -> bool:
        return equal_weights(folder, name)

    def epochs(name: str) -> list[dict[str, float]]:
        return out[name].epochs()

    train = ("train_loss", "train_acc", "train_samples")
    # Step 5: fully_shard instead of DDP trains the same model: the same losses, bit-equal
    # weights, BatchNorm statistics included (rank 0's, in both).
    fsdp, ddp = ([[e[k] for k in train] for e in epochs(n)] for n in "ad")
    assert fsdp == ddp and len(fsdp) == 2
    assert equal_to_ddp("a"), "FSDP2's whole weights equal DDP's"
    # Every rank scores as many test images (24 of 25): FSDP's forward is a collective.
    assert [e["test_samples"] for e in epochs("a")] == [24, 24]
    # The whole weights load into a bare model built by part 1's own build_model.
    assert f"checkpoint {folder / 'a.pt'} loads into a bare test_resnet" in out["a"].stdout
    assert function_source(FSDP2, "build_model") == function_source(PART1, "build_model")
    # Step 6: each rank holds half of every weight, gradient and momentum: its local shards.
    memory = {r["rank"]: r for r in records(out["m"], "memory")}
    assert sorted(memory) == ["0", "1"]
    whole = sum(int(row["params_bytes"]) for row in memory.values())
    for row in memory.values():
        for kind in ("params", "grads", "optimizer"):
            assert abs(int(row[f"{kind}_bytes"]) / whole - 0.5) < 0.02, row
    # Step 7: a sharded checkpoint per epoch, one file per rank and the .metadata, training as
    # before; C, resumed from epoch 1, trains epoch 2 alone into the same weights (momentum,
    # schedule and random state restored).
    assert equal_to_ddp("e")
    for epoch in ("epoch_1", "epoch_2"):
        files = sorted(p.name for p in (folder / "sharded" / epoch).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    assert [e["epoch"] for e in epochs("c")] == [2]
    assert epochs("c")[0]["train_loss"] == epochs("a")[1]["train_loss"]
    assert equal_to_ddp("c"), "resumed on 2 ranks: the uninterrupted run's weights"

    # On 1 rank (plain python), from epoch 2: nothing left to train, the 2 ranks' shards
    # resharded onto 1, bit for bit; then a checkpoint of another model stops the run in one
    # line.
    sharded = folder / "sharded" / "epoch_2"
    one_rank = [*TINY_RUN, "--epochs", "2", "--resume", str(sharded)]
    wrong = [*one_rank, "--model", "resnet10t", "--checkpoint", ""]
    f, bad = in_turn(
        [FSDP2_DCP, *one_rank, "--checkpoint", str(folder / "f.pt")],
        [FSDP2_DCP, *wrong],
        nprocs=0,
        check=False,
    )
    assert not f.epochs() and equal_to_ddp("f")
    # One rank holds every weight: the 2 ranks' shards added up to the whole, no more.
    assert one(f, "memory")["params_bytes"] == str(whole)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.describe()
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot resume from {sharded}: "), last


def test_drop_ins_train_part4s_model_as_ddp_and_resume_after_a_crash(
    fsdp2: tuple[dict[str, Run], Path], drop_in_crashed: tuple[Run, Path], tmp_path: Path
) -> None:
    """Step 8: part 4's training (fault tolerance's step 7) with --by-hand-ddp --zero1 prints
    what DDP and SGD printed, epoch by epoch, until a crash as it saves epoch 2's snapshot; run
    again, it resumes from epoch 1's (ZeRO1's whole state, consolidated on rank 0, read back
    into each rank's share) and ends on DDP's weights, bit for bit. The memory lines of step 8
    without flags (DDP), with them (ZeRO-1) and of step 6 (FSDP2) are the memory figure's."""
    out, folder = fsdp2
    crashed, snapshot = drop_in_crashed
    ddp = printed(out["d"])
    assert crashed.returncode != 0, crashed.describe()
    assert printed(crashed) == ddp, crashed.describe()
    assert f"saved snapshot {snapshot}: 1/2 epochs done" in crashed.stdout
    assert "2/2 epochs done" not in crashed.stdout, "the crash came as epoch 2's was saved"
    resumed = out["r"]
    assert f"resumed from {snapshot}: 1/2 epochs done" in resumed.stdout, resumed.describe()
    assert printed(resumed) == ddp[1:], resumed.describe()
    assert equal_weights(folder, "r"), "resumed with the drop-ins: DDP's weights, bit for bit"
    # without a flag it is fault tolerance's step 7: DDP and SGD, epoch 1 as train.py's
    assert printed(out["p"]) == ddp[:1]

    figure = import_script(MEMORY_FIGURE)
    sources = (("DDP", "p"), ("ZeRO-1", "r"), ("FSDP2", "m"))
    data = figure.parse("".join(f"== {name}\n{out[run].stdout}" for name, run in sources))
    measured, predicted = data["measured"], data["predicted"]
    assert data["params"] == 373658
    for rank in (0, 1):
        # DDP: all of it on every rank; ZeRO-1: whole weights and gradients, the momentum of
        # whole tensors about half each (an even split is the prediction); FSDP2: half of each
        assert measured["DDP"][rank] == predicted["DDP"][rank] == dict.fromkeys(KEPT, 4.0)
        zero1 = measured["ZeRO-1"][rank]
        assert zero1["params"] == zero1["grads"] == 4.0
        assert zero1["optimizer"] == pytest.approx(predicted["ZeRO-1"][rank]["optimizer"], rel=0.02)
        for kind, value in measured["FSDP2"][rank].items():
            assert value == pytest.approx(predicted["FSDP2"][rank][kind], rel=0.02), kind
    assert sum(measured["ZeRO-1"][r]["optimizer"] for r in (0, 1)) == pytest.approx(4.0, abs=1e-12)
    figure.draw(data, tmp_path / "memory.png")
    committed = Path(MEMORY_FIGURE).with_name("memory.png")
    assert_figure(tmp_path / "memory.png", committed)
    assert png_size(tmp_path / "memory.png") == png_size(REPO / committed)


KEPT = ("params", "grads", "optimizer")


@pytest.mark.slow
def test_memory_notebook_checks_its_predictions(
    by_hand: list[Run],
    fsdp2: tuple[dict[str, Run], Path],
    run_notebook,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The notebook asserts each prediction itself; here its printed checks are counted and read
    # again. It reads the outputs of steps 4 and 6 from the runs above, launching nothing.
    (tmp_path / "step4_zero1.log").write_text(by_hand[3].stdout)
    (tmp_path / "step6_memory.log").write_text(fsdp2[0]["m"].stdout)
    monkeypatch.setenv("BEYOND_DDP_LOGS", str(tmp_path))
    path = REPO / BEYOND / "memory.ipynb"
    notebook = run_notebook(path, cwd=path.parent)
    text = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    lines = [line for line in text.splitlines() if line.startswith("check ")]
    kinds = [line.split()[1] for line in lines]
    assert (kinds.count("zero1"), kinds.count("fsdp2"), kinds.count("mixed")) == (5, 6, 4)
    for check in (dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines):
        predicted, measured = float(check["predicted"]), float(check["measured"])
        assert measured == pytest.approx(predicted, rel=0.02), check
