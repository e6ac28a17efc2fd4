"""Your own script (part4_torchrun/your_script/): each reproduction runs twice under torchrun,
without --fix (the failure, the message or the measured divergence) and with it (the check
passes); the checker (checker/ddp_check.py) runs on the chapter's token stream model and on
planted mistakes (on the course's own scripts it runs inside the exercise autograder,
tests/test_exercises.py); every message the README indexes is asserted here."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, TORCHRUN, Run, checker, launch

FOLDER = "part4_torchrun/your_script"
CHECKER = [PYTHON, f"{FOLDER}/checker/ddp_check.py"]
TWO_RANKS = [TORCHRUN, "--standalone", "--nproc_per_node=2"]
# Seconds per launch; healthy ones take 3-8 s here.
TIMEOUT = 120
REPORT_LINE = re.compile(r"^ddp_check: (ok|FAIL|--)\s+(.+?): (.*)$", re.MULTILINE)
EPOCH_LINE = re.compile(r"^epoch (\d+) rank (\d) val_loss=([\d.]+) lr=([\d.e-]+)$", re.MULTILINE)


def torchrun(script: str, *args: str, checked: bool = False, check: bool = True) -> Run:
    """The script on 2 gloo ranks under torchrun; checked: under the checker's wrapper."""
    command = [*TWO_RANKS, f"{FOLDER}/{script}", *args]
    return launch([*CHECKER, *command] if checked else command, timeout=TIMEOUT, check=check)


def report(run: Run) -> dict[str, tuple[str, str]]:
    """The checker's verdicts: check name -> (status, detail)."""
    found = {name: (status, detail) for status, name, detail in REPORT_LINE.findall(run.stdout)}
    assert found, f"no ddp_check report\n{run.describe()}"
    return found


def verdict(found: dict[str, tuple[str, str]], name: str) -> tuple[str, str]:
    """The one check whose name starts with `name` (a model's or a loader's is appended)."""
    (match,) = [value for key, value in found.items() if key.startswith(name)]
    return match


def value(run: Run, key: str) -> str:
    (found,) = re.findall(rf"\b{key}=(\S+)", run.stdout)
    return found


def decisions_by_rank(run: Run) -> dict[int, list[tuple[int, float, float]]]:
    """rank -> [(epoch, val_loss, lr)] from decisions.py's epoch lines."""
    by_rank: dict[int, list[tuple[int, float, float]]] = {0: [], 1: []}
    for epoch, rank, loss, lr in EPOCH_LINE.findall(run.stdout):
        by_rank[int(rank)].append((int(epoch), float(loss), float(lr)))
    return by_rank


def load_script(name: str):
    """A chapter script as a module, without running its main()."""
    spec = importlib.util.spec_from_file_location(name, REPO / FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- decisions.py: rank-local decisions, the cooperative stop, the replica check ---------------


def test_rank_local_decisions_split_the_replicas_and_the_checker_catches_it(
    tmp_path: Path,
) -> None:
    # Recorded with the environment variables alone, reported afterwards (the README's 2nd way).
    records = tmp_path / "records"
    env = {"PYTHONPATH": str(REPO / FOLDER / "checker"), "DDP_CHECK_DIR": str(records)}
    run = launch([*TWO_RANKS, f"{FOLDER}/decisions.py"], timeout=TIMEOUT, env=env)
    by_rank = decisions_by_rank(run)
    # 12 epochs of 16 steps: 512 samples, 256 a rank, 16 a step
    assert len(by_rank[0]) == len(by_rank[1]) == 12, run.describe()
    # Each rank scores its own shard: other losses, so other plateaus, so other learning rates.
    assert by_rank[0][0][1] != by_rank[1][0][1]
    lrs = [[lr for _, _, lr in by_rank[rank]] for rank in (0, 1)]
    assert lrs[0] != lrs[1] and min(lrs[0] + lrs[1]) < 0.02, "each rank anneals on its own"
    drift = float(value(run, "max_abs_diff"))
    assert drift > 1e-3, "the replicas drifted apart, silently: the run exited 0"

    # The report from Python (the last test runs the command line's --report).
    found = {c.name: (c.status, c.detail) for c in checker().report(records)[1]}
    status, detail = verdict(found, "replicas equal")
    assert status == "FAIL" and "first '0.weight'" in detail, detail
    # The checker measures the same drift from the parameters it saved.
    assert f"max |difference| between ranks {drift:.4g}" in detail, (detail, drift)
    for name in ("same steps", "inputs disjoint", "same collectives"):
        assert verdict(found, name)[0] == "ok", found
    assert "(model 0: 192)" in verdict(found, "same steps")[1]


def test_all_reduced_decisions_keep_the_replicas_equal_and_a_signal_stops_all_together() -> None:
    # The twin of the test above, with --fix; and rank 1 alone gets SIGINT at step 150 (epoch 10).
    run = torchrun("decisions.py", "--fix", "--interrupt-at", "150", checked=True)
    by_rank = decisions_by_rank(run)
    assert by_rank[0] == by_rank[1], "every rank read the same loss, so took the same decisions"
    assert len(by_rank[0]) == 9 and by_rank[0][-1][2] < 0.02, "9 epochs, with the same annealing"
    for rank in (0, 1):
        assert f"rank {rank} stops after step 149: a signal" in run.stdout, run.describe()
    assert value(run, "max_abs_diff") == "0", "equal replicas, bit for bit"
    assert value(run, "steps") == "149"
    found = report(run)
    assert {status for status, _ in found.values()} == {"ok"}, found
    assert "(model 0: 149)" in verdict(found, "same steps")[1]
    assert "all_reduce at decisions.py:" in verdict(found, "same collectives")[1]


def test_a_rank_local_early_stop_hangs_until_the_timeout_and_the_checker_says_where() -> None:
    run = torchrun(
        "decisions.py", "--stop-below", "0.9", "--timeout", "3", checked=True, check=False
    )
    assert run.returncode != 0, run.describe()
    assert "rank 0 stops early" in run.stdout and "rank 1 stops early" not in run.stdout
    # Rank 0 waits at the barrier, rank 1 in its next gradient all-reduce, until one times
    # out and exits; the other times out too, or finds its peer gone.
    errors = re.findall(r"^\[rank(\d)\]: RuntimeError: (.*)$", run.stderr, re.MULTILINE)
    assert sorted(rank for rank, _ in errors) == ["0", "1"], run.describe()
    timed_out = "Timed out waiting 3000ms for recv operation to complete"
    assert any(timed_out in error for _, error in errors), errors
    assert all(timed_out in e or "Connection closed by peer" in e for _, e in errors), errors
    found = report(run)
    status, detail = verdict(found, "same steps")
    steps = re.search(r"\{0: (\d+), 1: (\d+)\}", detail)
    assert status == "FAIL" and steps, detail
    assert int(steps[2]) == int(steps[1]) + 1, "rank 1 went on to one more step"
    status, detail = verdict(found, "same collectives")
    assert status == "FAIL" and "rank 0 barrier at decisions.py" in detail
    assert "rank 1 none" in detail, detail
    assert "where each rank stopped" in run.stdout


def test_an_all_reduced_early_stop_stops_every_rank_and_the_check_stays_silent() -> None:
    # The twin of the test above, with --fix; the replica check runs every 8th step.
    run = torchrun("decisions.py", "--fix", "--stop-below", "0.9", "--check-every", "8")
    by_rank = decisions_by_rank(run)
    assert by_rank[0] == by_rank[1]
    last = by_rank[0][-1][0]
    assert last < 12 and by_rank[0][-1][1] < 0.9
    for rank in (0, 1):
        assert f"rank {rank} stops early after epoch {last}" in run.stdout
    assert value(run, "max_abs_diff") == "0" and value(run, "steps") == str(16 * last)
    assert "replicas differ" not in run.stderr, "the check passed at every 8th step"


def test_the_replica_check_stops_with_one_line_naming_the_first_differing_tensor() -> None:
    run = torchrun("decisions.py", "--check-every", "8", check=False)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "replicas differ" in line]
    assert len(lines) == 1, run.describe()
    match = re.fullmatch(
        r"error: replicas differ at step (\d+): first differing tensor '0.weight'"
        r" \(4 of 4 differ\)",
        lines[0],
    )
    assert match, lines
    # The first epoch whose end gave the ranks different learning rates (16 steps an epoch):
    # the check stops at its first call after that epoch.
    by_rank = decisions_by_rank(run)
    split = next(e for (e, _, a), (_, _, b) in zip(*by_rank.values(), strict=False) if a != b)
    assert int(match[1]) == (16 * split // 8 + 1) * 8, (match[1], split)
    assert "max_abs_diff" not in run.stdout, "stopped before the end"


# ---- token_stream.py and iterable_shards.py: data that is no map-style Dataset -----------------


def test_token_stream_blocks_keep_the_stream_and_the_global_validation_loss_is_exact() -> None:
    runs = {
        fix: torchrun("token_stream.py", *(["--fix"] if fix else []), checked=True)
        for fix in (False, True)
    }
    for fix, run in runs.items():
        shards = re.findall(r"^rank \d columns=8 rows=(\d+) steps=(\d+)$", run.stdout, re.MULTILINE)
        assert len(shards) == 2 and shards[0] == shards[1], "the same steps on every rank"
        # The checker proves what it can; a stream cut into every other token passes it too.
        found = report(run)
        for name in ("replicas equal", "same steps", "inputs disjoint", "same collectives"):
            assert verdict(found, name)[0] == "ok", (fix, found)
        assert run.returncode == 0
    val = {
        fix: re.findall(r"^epoch 2 rank (\d) val_loss=([\d.]+)$", run.stdout, re.MULTILINE)
        for fix, run in runs.items()
    }
    whole = {
        fix: float(re.findall(r"^epoch 2 one_process_val_loss=([\d.]+)$", run.stdout, re.M)[0])
        for fix, run in runs.items()
    }
    # Without --fix: each rank's own loss, on its own every-other-token stream.
    assert val[False][0][1] != val[False][1][1]
    # With --fix: one global loss, equal to one process scoring the whole stream.
    assert val[True][0][1] == val[True][1][1]
    assert abs(float(val[True][0][1]) - whole[True]) < 1e-5
    # Every other token teaches the wrong successor: far worse on the real stream (chance: 2.77).
    assert whole[False] > 2.77 > 1.5 > whole[True], whole
    assert "all_reduce at token_stream.py" in verdict(report(runs[True]), "same collectives")[1]


def test_token_stream_messages_without_contiguous_and_with_the_global_hidden_state() -> None:
    import torch

    stream = load_script("token_stream")
    data = stream.batchify(torch.arange(64) % stream.VOCAB, 4)
    left_half = data[:, :2]
    with pytest.raises(RuntimeError, match="view size is not compatible with input tensor's size"):
        stream.get_batch(left_half, 0, 3)
    x, y = stream.get_batch(left_half.contiguous(), 0, 3)
    assert x.shape == (3, 2) and y.shape == (6,)
    model = stream.TinyLM()
    with pytest.raises(
        RuntimeError, match=r"Expected hidden\[0\] size \(1, 2, 32\), got \[1, 4, 32\]"
    ):
        model(x, model.init_hidden(4))
    logits, _ = model(x, model.init_hidden(2))
    assert logits.shape == (3, 2, stream.VOCAB)


def test_iterable_dataset_sharded_by_rank_and_worker_reads_each_record_once() -> None:
    runs = {
        fix: torchrun("iterable_shards.py", *(["--fix"] if fix else []), checked=True, check=False)
        for fix in (False, True)
    }
    # 2 ranks x 2 loader workers, started by spawn, not by a fork after gloo's threads exist.
    for run in runs.values():
        copies = "dataset copies=4: 2 ranks x 2 loader workers, started by spawn"
        assert copies in run.stdout.splitlines(), run.describe()
    # Without --fix: each of the 4 copies reads all 103 records.
    unfixed = runs[False]
    assert unfixed.returncode == 1, unfixed.describe()
    assert "read=412 distinct=103 repeated=309 unread=0" in unfixed.stdout
    status, detail = verdict(report(unfixed), "inputs disjoint")
    assert status == "FAIL" and detail.startswith("103 of 103 distinct rows"), detail
    fixed = runs[True]
    assert fixed.returncode == 0, fixed.describe()
    batches = re.findall(r"^rank \d batches=(\d+) records=(\d+)$", fixed.stdout, re.MULTILINE)
    assert len(batches) == 2 and batches[0] == batches[1], "the same steps on every rank"
    read = int(value(fixed, "read"))
    assert value(fixed, "repeated") == "0" and read == int(value(fixed, "distinct"))
    assert 0 <= int(value(fixed, "unread")) < 4 and read % 4 == 0, "a tail under 4 records"
    assert verdict(report(fixed), "inputs disjoint")[0] == "ok"


# ---- wrapper.py: what the wrapper and the extra ranks change ----------------------------------


def effects(run: Run) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():
        if line.startswith("effect="):
            name, _, rest = line.removeprefix("effect=").partition(" ")
            found.setdefault(name, []).append(rest)
    return found


def test_wrapper_effects_fail_the_single_device_way_and_pass_the_ddp_way() -> None:
    import torch

    unfixed = effects(torchrun("wrapper.py"))
    assert unfixed["custom_method"] == [
        "error=AttributeError: 'DistributedDataParallel' object has no attribute 'init_hidden'"
    ]
    assert unfixed["save_model"] == [
        "error=UnpicklingError: WeightsUnpickler error: Unsupported global: GLOBAL"
        " torch.nn.parallel.distributed.DistributedDataParallel was not an allowed global by"
        " default."
    ]
    # The buffer made by a transpose fails, and so does the clone() the message asks for.
    for name in ("buffers", "buffers_remade"):
        (buffers,) = unfixed[name]
        assert buffers.startswith(
            "error=RuntimeError: unsupported operation: some elements of the input tensor and the"
            " written-to tensor refer to a single memory location. Please clone() the tensor"
        ), buffers
    assert unfixed["dropout"] == ["same_mask_on_every_rank=True"]
    (device,) = unfixed["device"]
    built, usable = torch.accelerator.current_accelerator(), torch.accelerator.is_available()
    if built is not None and not usable:
        # PyTorch's CUDA build on a machine without a GPU, as the test machine is
        assert device.startswith(f"device={built} backend=nccl error=RuntimeError: "), device
        if built.type == "cuda":
            assert "Found no NVIDIA driver on your system" in device
    else:
        assert device.endswith(" ok"), device
    assert unfixed["len_dataset"] == [
        "loader=DistributedSampler len_dataset=10 local_acc=50.0% global_acc=100.0%",
        "loader=Subset len_dataset=5 local_acc=100.0% global_acc=200.0%",
    ]

    fixed_run = torchrun("wrapper.py", "--fix")
    # forward_sync_buffers, not the deprecated broadcast_buffers: no FutureWarning on any rank
    for word in ("FutureWarning", "broadcast_buffers"):
        assert word not in fixed_run.stdout + fixed_run.stderr, fixed_run.describe()
    fixed = effects(fixed_run)
    assert fixed["custom_method"] == ["ok shape=(4, 8)"]
    assert fixed["save_model"] == ["ok loads into a bare Net"]
    assert fixed["buffers"] == ["ok forward_sync_buffers=False"]
    assert fixed["buffers_remade"] == ["ok forward_sync_buffers=True"], "or a buffer made plainly"
    assert fixed["dropout"] == ["same_mask_on_every_rank=False"]
    assert fixed["device"] == [
        f"device={built if usable else 'cpu'} backend={'nccl' if usable else 'gloo'} ok"
    ]
    assert all("acc=100.0% global_acc=100.0%" in line for line in fixed["len_dataset"])


# ---- equivalence.py: the recipe -----------------------------------------------------------------


def test_one_process_reproduces_the_original_and_two_ranks_match_it_then_drift_slowly() -> None:
    pattern = r"^equivalence ranks=(\d) .* dtype=(\w+) step=(\d+) max_abs_diff=(\S+)$"

    def diffs(run: Run) -> dict[tuple[str, int], float]:
        rows = re.findall(pattern, run.stdout, re.MULTILINE)
        return {(dtype, int(step)): float(diff) for _, dtype, step, diff in rows}

    alone = diffs(launch([PYTHON, f"{FOLDER}/equivalence.py"], timeout=TIMEOUT))
    assert len(alone) == 6 and set(alone.values()) == {0.0}, "bit for bit, at every checkpoint"
    two = diffs(torchrun("equivalence.py"))
    assert sorted(two) == sorted(alone)
    # After one step: equal to rounding (float32 ~1e-7, float64 ~1e-16 of weights of order 1).
    assert two["float32", 1] < 1e-6 and two["float64", 1] < 1e-14, two
    # After that the difference grows, slowly, and float64 stays far below float32.
    for dtype in ("float32", "float64"):
        assert two[dtype, 1] <= two[dtype, 10] <= two[dtype, 100], two
    assert two["float32", 100] < 1e-4 and two["float64", 100] < 1e-12, two
    assert two["float64", 100] < two["float32", 1], two
    # The recipe's warning on data order: one replica of a DistributedSampler does not draw the
    # order of shuffle=True from the same seed.
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(32))
    torch.manual_seed(0)
    shuffled = [int(i) for i in DataLoader(data, batch_size=None, shuffle=True)]
    sampled = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    assert sorted(shuffled) == sorted(sampled) == data and shuffled != sampled


# ---- the checker's report alone ----------------------------------------------------------------


def test_checker_reports_loaders_that_every_rank_reads_whole_and_refuses_bad_input(
    tmp_path: Path,
) -> None:
    # Records as the recorder writes them: both ranks drew samples 0-3 from a loader without a
    # DistributedSampler (no launch: the report alone).
    for rank in (0, 1):
        events = [
            {"event": "init", "rank": rank, "world_size": 2, "backend": "gloo"},
            {"event": "batch", "rank": rank, "loader": 0, "pass": 0, "samples": [0, 1, 2, 3],
             "sampler": "RandomSampler", "dataset": "MNIST"},
            {"event": "exit", "rank": rank},
        ]  # fmt: skip
        lines = "".join(json.dumps(e) + "\n" for e in events)
        (tmp_path / f"{100 + rank}.jsonl").write_text(lines)
    run = launch([*CHECKER, "--report", str(tmp_path)], timeout=TIMEOUT, check=False)
    assert run.returncode == 1, run.describe()
    status, detail = verdict(
        report(run), "loader samples disjoint (loader 0, MNIST, RandomSampler)"
    )
    assert status == "FAIL" and detail.startswith("4 samples drawn by more than one rank"), detail
    assert verdict(report(run), "replicas equal")[0] == "--"
    # No records: nothing proved, so a failure.
    empty = tmp_path / "empty"
    empty.mkdir()
    run = launch([*CHECKER, "--report", str(empty)], timeout=TIMEOUT, check=False)
    assert run.returncode == 1 and "nothing to check" in run.stdout, run.describe()
    # Records of two runs in one folder, no command, a folder that is missing: one line each.
    (tmp_path / "102.jsonl").write_text((tmp_path / "100.jsonl").read_text())
    run = launch([*CHECKER, "--report", str(tmp_path)], timeout=TIMEOUT, check=False)
    assert run.returncode == 2 and "rank 0 appears in two processes" in run.stderr
    for args in ([], ["--report", str(tmp_path / "missing")]):
        run = launch([*CHECKER, *args], timeout=TIMEOUT, check=False)
        assert run.returncode == 2 and "error:" in run.stderr and "Traceback" not in run.stderr
