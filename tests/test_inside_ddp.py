"""Inside DDP: each experiment in part3_ddp/experiments/ makes one claim, and the test asserts
it on the script's real output under its real launcher (mp.spawn, torchrun). One launch per
script; the notebooks are executed end to end (slow)."""

from __future__ import annotations

import itertools
import math
import re
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
from conftest import (
    PYTHON,
    REPO,
    TORCHRUN,
    Probe,
    Run,
    assert_figure,
    free_port,
    import_script,
    launch,
    png_size,
)

# Seconds per launch; healthy runs here take 5-20 s.
TIMEOUT = 180
EXPERIMENTS = "part3_ddp/experiments"
PAIR = re.compile(r"(\w+)=(\S+)")


def experiment(script: str, *args: str) -> Run:
    """One launch of an experiment script under its default start method (spawn), with the
    probe. Every rank must exit with its process group released: a group still alive when
    Python shuts down is torn down during interpreter shutdown, where gloo can abort the process
    ("terminate called without an active exception") after correct results."""
    with tempfile.TemporaryDirectory() as directory:
        run = launch(
            [PYTHON, f"{EXPERIMENTS}/{script}", *args], timeout=TIMEOUT, probe_dir=Path(directory)
        )
        probe = Probe.read(Path(directory))
    assert len(probe.ranks()) >= 2, f"the probe saw ranks {probe.ranks()}\n{run.describe()}"
    probe.assert_groups_released(run.describe())
    return run


def records(run: Run, kind: str) -> list[dict[str, str]]:
    """The key=value pairs of every stdout line starting with `kind `; a bare last token is
    kept as 'rest'."""
    out = []
    for line in run.stdout.splitlines():
        if line.startswith(kind + " "):
            fields = dict(PAIR.findall(line))
            last = line.split()[-1]
            if "=" not in last:
                fields["rest"] = last
            out.append(fields)
    assert out, f"no '{kind}' lines\n{run.describe()}"
    return out


def drawing(topic: str) -> ModuleType:
    """The figure's drawing script, part3_ddp/experiments/figures/draw_<topic>.py, imported."""
    return import_script(f"{EXPERIMENTS}/figures/draw_{topic}.py")


def draw_figure(module: ModuleType, data: object, path: Path) -> None:
    """draw() writes a PNG of the house size (at least 200 px high here); the committed one is
    there too, linked from the pages."""
    module.draw(data, path)
    assert_figure(path, f"{EXPERIMENTS}/figures/{path.name}")
    assert png_size(path)[1] >= 200, png_size(path)


def assert_only_lines(run: Run, *kinds: str) -> None:
    """Every line is one of the script's evidence lines: nothing glued, none from a stray rank."""
    for line in run.stdout.splitlines():
        assert line.split(" ", 1)[0] in kinds, (
            f"unexpected or glued line: {line!r}\n{run.describe()}"
        )


def test_shuffling_repeats_without_set_epoch_and_costs_accuracy_when_epochs_are_cut(
    tmp_path: Path,
) -> None:
    # Part 1: 2 ranks, 16 integers, 3 epochs. Part 2: 2 ranks x 16 samples per step, 2048
    # training samples, 8 epochs, full or cut after 4 steps.
    run = experiment("shuffling.py")
    assert_only_lines(run, "indices", "moved", "train")
    drawn: dict[tuple[str, int, int], list[int]] = {}
    for r in records(run, "indices"):
        key = r["set_epoch"], int(r["epoch"]), int(r["rank"])
        drawn[key] = [int(i) for i in r["rest"].split(",")]
    for flag, epoch, _ in drawn:
        union = sorted(drawn[flag, epoch, 0] + drawn[flag, epoch, 1])
        assert union == list(range(16)), f"set_epoch={flag} epoch {epoch}: ranks split the data"
    for epoch in (1, 2):
        for rank in (0, 1):
            assert drawn["off", epoch, rank] == drawn["off", 0, rank], "no set_epoch: repeats"
        on_now, on_before = set(drawn["on", epoch, 0]), set(drawn["on", epoch - 1, 0])
        assert on_now != on_before, "with set_epoch rank 0's shard changes"
        assert on_now & set(drawn["on", epoch - 1, 1]), "samples move from rank 1 to rank 0"
    moved = {
        (r["set_epoch"], r["to_epoch"], r["rank"]): int(r["count"]) for r in records(run, "moved")
    }
    assert all(n == 0 for (flag, _, _), n in moved.items() if flag == "off")
    assert all(n > 0 for (flag, _, _), n in moved.items() if flag == "on")

    train: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in records(run, "train"):
        train.setdefault((r["epochs"], r["set_epoch"]), []).append(r)
    assert sorted(train) == [(e, f) for e in ("capped", "full") for f in ("off", "on")]
    assert all(
        [r["epoch"] for r in rows] == [str(e) for e in range(1, 9)] for rows in train.values()
    )

    def acc(row: dict[str, str]) -> float:
        return float(row["test_acc"].rstrip("%"))

    seen = {key: [int(r["seen"]) for r in rows] for key, rows in train.items()}
    final = {key: rows[-1] for key, rows in train.items()}
    for flag in ("off", "on"):
        assert seen["full", flag] == [2048] * 8, "full epochs see every sample, either way"
        assert acc(final["full", flag]) > 80, "both learn (chance: 10%)"
    # Measured here: 88.11% (off) and 88.65% (on); over --seed values 0-4 the gap stayed within 0.6.
    gap_full = acc(final["full", "on"]) - acc(final["full", "off"])
    assert abs(gap_full) < 2, "with full epochs the repeated order costs little"
    # Cut after 4 steps of 2 x 16: without set_epoch, the same 128 samples every epoch.
    assert seen["capped", "off"] == [128] * 8
    assert seen["capped", "on"][0] == 128 and seen["capped", "on"][-1] > 4 * 128
    assert seen["capped", "on"] == sorted(set(seen["capped", "on"])), "coverage grows"
    # Measured here: 73.85% (off) and 87.23% (on); over --seed values 0-4 a gap of 11-13 points.
    gap_capped = acc(final["capped", "on"]) - acc(final["capped", "off"])
    assert gap_capped > 5, "cut epochs without set_epoch: lower test accuracy"
    # ... while the training loss is LOWER without set_epoch: it memorises its 128 samples.
    assert float(final["capped", "off"]["loss"]) < float(final["capped", "on"]["loss"])

    # The figure (part 3, step 3 and the experiments): what its caption says, on what it plots.
    figure = drawing("shuffling")
    plotted = figure.parse(run.stdout)
    for flag in ("off", "on"):
        assert len(plotted[flag]) == 3 and all(len(e) == 2 for e in plotted[flag])
        for shards in plotted[flag]:
            assert sorted(shards[0] + shards[1]) == list(range(16)), "disjoint, the whole set"
    assert all(epoch == plotted["off"][0] for epoch in plotted["off"]), "off: epoch 0 again"
    for before, after in itertools.pairwise(plotted["on"]):
        assert set(after[0]) & set(before[1]), "on: samples move from rank 1 to rank 0"
    draw_figure(figure, plotted, tmp_path / "shuffling.png")


def test_eval_padding_counts_duplicates_and_strided_sampler_is_exact(tmp_path: Path) -> None:
    # 10,000 samples on 3 ranks
    run = experiment("eval_padding.py")
    assert_only_lines(run, "reference", "shard", "global")
    (reference,) = records(run, "reference")
    assert reference["total"] == "10000"
    shards = {(r["sampler"], r["rank"]): r for r in records(run, "shard")}
    padded = [shards["padded", str(k)]["total"] for k in range(3)]
    assert padded == ["3334"] * 3, "padded to equal shards"
    strided = sum(int(shards["strided", str(k)]["total"]) for k in range(3))
    assert strided == 10_000, "strided: each sample once"
    glob = {(r["sampler"], r["method"]): r for r in records(run, "global")}
    assert glob["padded", "all_reduce"]["total"] == "10002", "two duplicates counted"
    assert glob["padded", "all_reduce"]["acc"] != reference["acc"], "padding shifts the accuracy"
    assert glob["strided", "all_reduce"]["correct"] == reference["correct"]
    assert glob["strided", "all_reduce"]["acc"] == reference["acc"], "= one-process accuracy"
    # torchmetrics syncs the same counts as the hand-written all_reduce; its default is macro.
    for sampler in ("padded", "strided"):
        by_hand = glob[sampler, "all_reduce"]["acc"]
        assert glob[sampler, "torchmetrics_micro"]["acc"] == by_hand
        assert glob[sampler, "torchmetrics_default_macro"]["acc"] != by_hand
    local = {shards["strided", str(k)]["acc"] for k in range(3)}
    assert len(local) > 1, "before the all_reduce each rank has its own, different accuracy"

    # The figure: the padding repeats the first samples at the end of the last ranks' shards.
    figure = drawing("eval_padding")
    plotted = figure.parse(run.stdout)
    padded, strided = plotted["padded"], plotted["strided"]
    assert padded["twice"] == [0, 1] and strided["twice"] == []
    assert [s["last"][-1] for s in padded["shards"]] == [9999, 0, 1], "padding: 0 and 1 again"
    assert [s["first"] for s in strided["shards"]] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert [s["total"] for s in strided["shards"]] == [3334, 3333, 3333]
    assert (padded["total"], strided["total"]) == (10_002, plotted["reference"]["total"])
    assert strided["acc"] == plotted["reference"]["acc"] != padded["acc"]
    draw_figure(figure, plotted, tmp_path / "eval_padding.png")


def test_metric_sync_sum_is_not_an_average_and_only_rank0_prints() -> None:
    # 2 ranks x 32 samples, 3 steps
    run = experiment("metric_sync.py")
    assert_only_lines(run, "losses", "reduce", "average", "accuracy")
    kinds = ("losses", "reduce", "average", "accuracy")
    for kind in kinds:
        steps = [r["step"] for r in records(run, kind)]
        assert steps == ["0", "1", "2"], f"one '{kind}' line per step: rank 0 only"
    for losses, reduced, averaged, accuracy in zip(*map(records, [run] * 4, kinds), strict=True):
        per_rank = [float(v) for v in losses["per_rank"].split(",")]
        assert len(per_rank) == 2 and per_rank[0] != per_rank[1], "each rank has its own loss"
        mean = sum(per_rank) / 2
        reduced_value = float(reduced["value"])
        assert math.isclose(reduced_value, sum(per_rank), abs_tol=1e-5), "reduce(SUM): the sum"
        assert not math.isclose(reduced_value, mean, rel_tol=0.1), "... which is not the average"
        assert math.isclose(float(averaged["all_reduce_then_divide"]), mean, abs_tol=1e-5)
        # gloo accepts ReduceOp.AVG (older torch raised on it): the same mean.
        assert math.isclose(float(averaged["all_reduce_avg"]), mean, abs_tol=1e-5)
        assert accuracy["gathered"] == "64", "predictions of both ranks gathered"
        assert accuracy["acc"] == f"{100 * int(accuracy['correct']) / 64:.2f}%"


def test_ddp_equals_one_big_batch_until_batchnorm(tmp_path: Path) -> None:
    # 2 ranks x 8 vs 1 x 16, 5 SGD steps; each line: rank 0's weights against the reference
    run = experiment("ddp_equals_big_batch.py")
    assert_only_lines(run, "compare", "syncbatchnorm")
    figure = drawing("ddp_equals_big_batch")
    plotted = figure.parse(run.stdout)
    diffs = {(r["setup"], r["model"], r["dtype"]): r["diffs"] for r in plotted}
    equal = {(r["setup"], r["model"], r["dtype"]): r["replicas_equal"] for r in plotted}
    assert list(diffs) == [
        ("ddp", "mlp", "float64"),
        ("ddp", "mlp", "float32"),
        ("no_sampler", "mlp", "float32"),
        ("no_wrap", "mlp", "float32"),
        ("ddp", "mlp_batchnorm", "float32"),
    ]
    assert all(len(d) == 5 for d in diffs.values()), "a difference after each of 5 steps"
    assert max(diffs["ddp", "mlp", "float64"]) < 1e-12, "float64: equal up to rounding"
    assert max(diffs["ddp", "mlp", "float32"]) < 1e-6, "float32: one rounding (~1e-8)"
    # the planted mistakes and BatchNorm: another training from the first step on
    for broken in [("no_sampler", "mlp"), ("no_wrap", "mlp"), ("ddp", "mlp_batchnorm")]:
        assert min(diffs[(*broken, "float32")]) > 1e-4, f"{broken}: not one big batch"
    # without the wrap the ranks drift apart; with it they stay equal, even when wrong
    assert [key[0] for key, same in equal.items() if not same] == ["no_wrap"]
    (sync,) = records(run, "syncbatchnorm")
    assert "error=ValueError" in run.stdout and "GPU" in run.stdout, f"SyncBatchNorm on CPU: {sync}"
    draw_figure(figure, plotted, tmp_path / "ddp_equals_big_batch.png")


def test_allreduce_by_hand_naive_and_ring_equal_dist_all_reduce() -> None:
    # 3 ranks
    run = experiment("allreduce_by_hand.py", "--sizes", "256,65536", "--repeats", "2")
    assert_only_lines(run, "grad_averaging", "fp16_grad", "check", "time")
    (grads,) = records(run, "grad_averaging")
    assert float(grads["max_abs_diff_vs_ddp"]) < 1e-12, "averaging .grad by hand = DDP"
    # A float16 gradient of 40000 on 3 ranks: the sum (120000) overflows float16 (max 65504).
    # DDP divides each gradient by the world size before summing, so its mean stays finite.
    (fp16,) = records(run, "fp16_grad")
    assert float(fp16["ddp"]) == float(fp16["divide_then_sum"]) == 40000, fp16
    assert float(fp16["sum_then_divide"]) == math.inf, "summing first overflows"
    assert float(fp16["avg_op"]) == math.inf, "gloo's AVG is a SUM, then a division"
    checks = records(run, "check")
    checked = {(r["algorithm"], r["numel"]) for r in checks}
    assert checked == {(a, n) for a in ("naive", "ring") for n in ("1", "7", "1000")}
    assert all(float(r["max_abs_diff_vs_all_reduce"]) < 1e-12 for r in checks)
    times = records(run, "time")
    assert [r["numel"] for r in times] == ["256", "65536"]
    for row in times:
        assert all(float(row[f"{name}_ms"]) > 0 for name in ("builtin", "naive", "ring"))


def test_no_sync_accumulation_same_update_fewer_allreduces() -> None:
    # 2 ranks, 3 updates x 4 micro-batches
    run = experiment("no_sync_accumulation.py")
    assert_only_lines(run, "run", "compare")
    calls = {r["mode"]: int(r["allreduce_calls"]) for r in records(run, "run")}
    # no_sync around forward + backward: 1 all-reduce per update; around backward only: K.
    assert calls == {"sync_every_step": 12, "no_sync": 3, "no_sync_backward_only": 12}
    diff = {r["mode"]: float(r["max_abs_diff"]) for r in records(run, "compare")}
    assert diff["no_sync"] < 1e-12, "accumulating without sync gives the same update"


@pytest.mark.parametrize("nprocs", [1, 2])
def test_helper_style_runs_with_one_or_more_processes(nprocs: int, probe_dir: Path) -> None:
    run = launch(
        [PYTHON, "part3_ddp/helper_style/train.py", "--nprocs", str(nprocs)],
        timeout=TIMEOUT,
        probe_dir=probe_dir,
    )
    assert_only_lines(run, "arg", "world_size=1", "world_size=2", "epoch")
    wrapped = "DistributedDataParallel" if nprocs > 1 else "Sequential"
    expected = f"world_size={nprocs} device=cpu wrapped={wrapped}"
    assert expected in run.stdout, "wrap in DDP only when distributed"
    epochs = re.findall(r"^epoch (\d)/2 .* samples=(\d+)$", run.stdout, re.MULTILINE)
    assert epochs == [("1", "512"), ("2", "512")], "one line per epoch, metrics over all ranks"
    probe = Probe.read(probe_dir)
    if nprocs == 1:
        assert not probe.events("init"), "a world of one needs no process group"
        assert sorted(probe.indices(None)) == list(range(512))
    else:
        assert sorted(probe.ranks()) == [0, 1]
        probe.assert_groups_released()
        for epoch in (0, 1):
            both = probe.indices(0, epoch=epoch) + probe.indices(1, epoch=epoch)
            assert sorted(both) == list(range(512))


# ---- part4_torchrun/tools/diagnose.py ------------------------------------------------------------

DIAGNOSE = "part4_torchrun/tools/diagnose.py"


def assert_diagnosis_ok(run: Run, world_size: int, launcher: str) -> None:
    starts = records(run, "start")
    started = sorted(int(r["rank"].split("/")[0]) for r in starts)
    assert started == list(range(world_size)), "every rank says hello"
    assert {r["launcher"] for r in starts} == {launcher}
    reports = records(run, "report")
    reported = [r["rank"] for r in reports]
    assert reported == [f"{k}/{world_size}" for k in range(world_size)], "rank 0 reports all"
    for r in reports:
        assert {"host", "local_rank", "device", "backend", "torch", "python"} <= set(r)
        assert r["device"] == "cpu" and r["backend"] == "gloo"
    expected = world_size * (world_size + 1) // 2
    assert f"all_reduce ok: sum={expected} expected={expected}" in run.stdout
    assert "barrier ok" in run.stdout and f"OK {world_size} rank(s)" in run.stdout


def test_diagnose_under_python_and_torchrun() -> None:
    assert_diagnosis_ok(launch([PYTHON, DIAGNOSE], timeout=TIMEOUT), 1, "python")
    run = launch([TORCHRUN, "--standalone", "--nproc_per_node=2", DIAGNOSE], timeout=TIMEOUT)
    assert_diagnosis_ok(run, 2, "torchrun")
    local_ranks = sorted(r["local_rank"] for r in records(run, "report"))
    assert local_ranks == ["0", "1"]


def test_diagnose_under_srun_variables() -> None:
    # What srun gives each task of a 2-task step on this machine; the job script exports
    # MASTER_ADDR and MASTER_PORT.
    # Each task is waited for by its pid: `wait -n` reports 127 for one that already ended.
    tasks = " ".join(
        f"SLURM_PROCID={k} SLURM_LOCALID={k} {PYTHON} {DIAGNOSE} & pid{k}=$!;" for k in (0, 1)
    )
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_ID": "4242",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    run = launch(["bash", "-c", f"{tasks} wait $pid0 && wait $pid1"], timeout=TIMEOUT, env=env)
    assert_diagnosis_ok(run, 2, "srun")


def test_diagnose_in_a_batch_script_outside_a_step_is_a_world_of_one() -> None:
    # The batch script of a 2-task job: SLURM_PROCID and SLURM_NTASKS=2, but no step. It must
    # not wait for a second rank (a wait would fail after --timeout).
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4242"}
    run = launch([PYTHON, DIAGNOSE, "--timeout", "20"], timeout=TIMEOUT, env=env)
    assert_diagnosis_ok(run, 1, "python")


def test_diagnose_in_an_srun_step_without_master_addr_says_what_to_export() -> None:
    # An srun without --ntasks-per-node, as train.py refuses it: no SLURM_NTASKS_PER_NODE.
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_ID": "4242",
        "MASTER_ADDR": "",
        "MASTER_PORT": "",
    }
    run = launch([PYTHON, DIAGNOSE, "--timeout", "5"], timeout=TIMEOUT, env=env, check=False)
    assert run.returncode == 1, run.describe()
    assert run.stderr.startswith("error: ") and "Traceback" not in run.stderr, run.describe()
    assert "export" in run.stderr and "MASTER_ADDR" in run.stderr and "MASTER_PORT" in run.stderr
    assert "SLURM_NTASKS_PER_NODE" in run.stderr and "--ntasks-per-node" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.describe()
    assert "start " not in run.stdout, "stops before it waits for anyone"


def test_diagnose_names_the_failing_step_and_exits_nonzero() -> None:
    # Rank 0 of a world of 2 whose rank 1 never comes: the rendezvous times out.
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    run = launch([PYTHON, DIAGNOSE, "--timeout", "2"], timeout=TIMEOUT, env=env, check=False)
    assert run.returncode == 1, run.describe()
    assert "FAILED step=init_process_group rank=0" in run.stdout
    assert "MASTER_PORT" in run.stdout and "NCCL_DEBUG=INFO" in run.stdout, "says what to check"
    assert "report " not in run.stdout


def test_diagnose_with_a_bad_address_says_so_first_in_one_line() -> None:
    """A MASTER_ADDR that does not resolve fails at once (not after --timeout), and the first
    line after `start` says which check failed, on which rank and host, and why; what to check
    follows. Nothing else comes before it, not even the libraries' warnings."""
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "no-such-node.invalid",
        "MASTER_PORT": str(free_port()),
    }
    run = launch([PYTHON, DIAGNOSE, "--timeout", "600"], timeout=60, env=env, check=False)
    assert run.returncode == 1 and not run.stderr.strip(), run.describe()
    lines = run.stdout.splitlines()
    assert lines[0].startswith("start ") and len(lines) > 2, run.describe()
    summary = lines[1]
    assert summary.startswith("FAILED step=master address rank=1 host="), run.describe()
    assert "'no-such-node.invalid' does not resolve" in summary, run.describe()
    assert lines[2].startswith("  check: ") and "scontrol show hostnames" in lines[2]


# ---- notebooks ------------------------------------------------------------------------------

NOTEBOOKS = sorted(
    str(p.relative_to(REPO))
    for p in (REPO / "part3_ddp").rglob("*.ipynb")
    if ".ipynb_checkpoints" not in p.parts
)


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_end_to_end(notebook: str, run_notebook) -> None:
    path = REPO / notebook
    # Raises CellExecutionError on the first failing cell.
    nb = run_notebook(path, cwd=path.parent)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook draws its plots"


def test_notebooks_exist() -> None:
    assert "part3_ddp/experiments/inside_ddp.ipynb" in NOTEBOOKS


def test_when_ddp_copies_rank0s_state() -> None:
    """DDP copies rank 0's buffers before the first forward after the wrap and before a forward
    that follows a forward with gradients, whatever the module's mode; its weights only when it
    is built (torch 2.15): what the course's evaluation through the wrapper and its snapshot
    loading rest on."""
    run = experiment("when_ddp_syncs.py")
    kinds = ("trained", "first_eval_forward", "later_eval_forwards", "train_forwards")
    assert_only_lines(
        run, "first_forward_after_wrap", *kinds, "load_on_rank0_after_wrap", "load_on_every_rank"
    )
    # each rank marked its buffers after the wrap: the first forward, in eval mode and without
    # gradients, still copies rank 0's (the constructor sets the flag)
    (after_wrap,) = records(run, "first_forward_after_wrap")
    assert after_wrap == {"mode": "eval", "grad": "off", "buffers_copied": "True"}
    trained, first, later, training = (records(run, kind)[0] for kind in kinds)
    # after training each rank's buffers hold its own last batch: the bare models differ
    assert trained == {"buffers_equal": "False", "bare_scores_equal": "False"}
    # the first no_grad forward through the wrapper: every rank scores rank 0's model
    assert first == {"buffers_equal": "True", "equal_to_rank0": "True", "scores_equal": "True"}
    # 3 forwards on rank 0, 2 on rank 1, no copy and no wait (a copy would have hung)
    assert later == {"per_rank": "3,2", "buffers_copied": "False"}
    assert training == {"buffers_copied_first": "False", "buffers_copied_second": "True"}
    after_wrap = records(run, "load_on_rank0_after_wrap")[0]["weights_equal_after_steps"]
    every_rank = records(run, "load_on_every_rank")[0]["weights_equal_after_steps"]
    assert (after_wrap, every_rank) == ("False", "True"), "DDP copies weights when built only"
