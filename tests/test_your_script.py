"""Your own script (part4_torchrun/your_script/): each reproduction runs twice under torchrun,
without --fix (the failure, the message or the measured divergence) and with it (the check
passes); the checker (checker/ddp_check.py) runs on the chapter's token stream model and on
planted mistakes (on the course's own scripts it runs inside the exercise autograder,
tests/test_exercises.py); every message the README indexes is asserted here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
from conftest import (
    CHECKER_COMMAND,
    PYTHON,
    REPO,
    TORCHRUN_2,
    YOUR_SCRIPT,
    Run,
    checker,
    free_port,
    launch,
    launch_at_once,
    with_environ,
)

# Seconds per launch; healthy ones take 3-8 s here.
TIMEOUT = 120
REPORT_LINE = re.compile(r"^ddp_check: (ok|FAIL|--)\s+(.+?): (.*)$", re.MULTILINE)
EPOCH_LINE = re.compile(r"^epoch (\d+) rank (\d) val_loss=([\d.]+) lr=([\d.e-]+)$", re.MULTILINE)


def torchrun(script: str, *args: str, checked: bool = False, check: bool = True) -> Run:
    """The script on 2 gloo ranks under torchrun; checked: under the checker's wrapper."""
    command = [*TORCHRUN_2, f"{YOUR_SCRIPT}/{script}", *args]
    command = [*CHECKER_COMMAND, *command] if checked else command
    return launch(command, timeout=TIMEOUT, check=check)


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
    spec = importlib.util.spec_from_file_location(name, REPO / YOUR_SCRIPT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- decisions.py: rank-local decisions, the cooperative stop, the replica check ---------------


def test_rank_local_decisions_split_the_replicas_and_the_checker_catches_it(
    tmp_path: Path,
) -> None:
    # Recorded with the environment variables alone, reported afterwards (the README's 2nd way).
    records = tmp_path / "records"
    env = {"PYTHONPATH": str(REPO / YOUR_SCRIPT / "checker"), "DDP_CHECK_DIR": str(records)}
    run = launch([*TORCHRUN_2, f"{YOUR_SCRIPT}/decisions.py"], timeout=TIMEOUT, env=env)
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
    # The transposed buffer beside BatchNorm's: copied with them, it passes.
    assert unfixed["buffers_beside"] == ["ok forward_sync_buffers=True"]
    # A checkpoint of the wrapper's weights on every rank: two writers, `module.` keys.
    assert unfixed["checkpoint"] == [
        'writers=2 error=RuntimeError: Missing key(s) in state_dict: "pe", "linear.weight",'
        ' "linear.bias".'
    ]
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
    # A shard's last batch is shorter than --batch-size: 6 samples of 3 x 3 a rank, batches of 4.
    assert unfixed["full_batch"] == [
        "error=RuntimeError: shape '[4, -1]' is invalid for input of size 18"
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
    assert fixed["buffers_beside"] == ["ok forward_sync_buffers=True"]
    assert fixed["checkpoint"] == ["writers=1 ok loads into a bare Net"]
    assert fixed["device"] == [
        f"device={built if usable else 'cpu'} backend={'nccl' if usable else 'gloo'} ok"
    ]
    assert all("acc=100.0% global_acc=100.0%" in line for line in fixed["len_dataset"])
    assert fixed["full_batch"] == ["ok rows=[4, 2]"]


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
    run = launch([*CHECKER_COMMAND, "--report", str(tmp_path)], timeout=TIMEOUT, check=False)
    assert run.returncode == 1, run.describe()
    status, detail = verdict(
        report(run), "loader samples disjoint (loader 0, MNIST, RandomSampler)"
    )
    assert status == "FAIL" and detail.startswith("4 samples drawn by more than one rank"), detail
    assert verdict(report(run), "replicas equal")[0] == "--"
    # No records: nothing proved, so a failure.
    empty = tmp_path / "empty"
    empty.mkdir()
    run = launch([*CHECKER_COMMAND, "--report", str(empty)], timeout=TIMEOUT, check=False)
    assert run.returncode == 1 and "nothing to check" in run.stdout, run.describe()
    # Records of two runs in one folder, no command, a folder that is missing: one line each.
    (tmp_path / "102.jsonl").write_text((tmp_path / "100.jsonl").read_text())
    run = launch([*CHECKER_COMMAND, "--report", str(tmp_path)], timeout=TIMEOUT, check=False)
    assert run.returncode == 2 and "rank 0 appears in two processes" in run.stderr
    for args in ([], ["--report", str(tmp_path / "missing")]):
        run = launch([*CHECKER_COMMAND, *args], timeout=TIMEOUT, check=False)
        assert run.returncode == 2 and "error:" in run.stderr and "Traceback" not in run.stderr
    # Without torchrun on PATH: the same launch through Python's module, in one line.
    run = launch(
        [*CHECKER_COMMAND, "--deadline", "5", "torchrun", "--standalone", "my script.py"],
        timeout=TIMEOUT,
        check=False,
        env={"PATH": str(empty)},
    )
    assert run.returncode == 2, run.describe()
    assert run.stderr.splitlines()[-1] == (
        "ddp_check.py: error: cannot run 'torchrun': not on PATH; Python's module is the same"
        f" launcher: python {CHECKER_COMMAND[1]} --deadline 5 {PYTHON} -m torch.distributed.run"
        " --standalone 'my script.py'"
    ), run.describe()


# ---- the checker on planted ports: buffers, draws, seeds, duplicates, deadlines, signals -------

# Seconds per launch of the tests below (a loaded 2-core machine: 8-20 s each).
SLOW = 180
# A port's mistakes, in one script: BatchNorm statistics left as each rank's, noise drawn in
# forward from one seed for all, a DistributedSampler seeded by rank, a frozen loss network
# whose weights rank 0 alone loads, a checkpoint every rank writes from the wrapper; and what is
# right but was misread: a rank-0-first barrier, a data set whose rows come in identical pairs,
# an evaluation tail scored on every rank. Without --fix the script never calls
# destroy_process_group() and drops its model and loss network with main(); the test launches
# it with `python -m torch.distributed.run`. --fix: seed + rank after building the model, one
# sampler seed, rank 0's buffers broadcast at the end, the loss network loaded on every rank,
# rank 0 saving the module's state_dict, the tail scored after the all-reduce.
PLANTED = """\
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init_process_group: a clean exit)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

fix = "--fix" in sys.argv
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.lin(x) + torch.randn(x.shape[0], 4))


def main():
    model = DDP(Noisy())
    critic = torch.nn.Linear(4, 1).requires_grad_(False)  # a frozen loss network
    if fix or rank == 0:  # its weights, on every rank or on rank 0 alone
        critic.load_state_dict({"weight": torch.ones(1, 4), "bias": torch.zeros(1)})
    if fix:
        torch.manual_seed(0 + rank)  # the seed, 0, plus the rank
    if rank == 0:
        dist.barrier()  # rank 0 first
    else:
        dist.barrier()  # the others after it
    rows = torch.arange(8.0).repeat_interleave(2)[:, None].expand(16, 4).contiguous()
    data = TensorDataset(rows)
    alike = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    seed = 0 if fix else rank
    seeded = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for loader in (alike, seeded):
        for (x,) in loader:
            optimizer.zero_grad()
            critic(model(x)).pow(2).mean().backward()
            optimizer.step()
    if fix:
        for buffer in model.module.buffers():
            dist.broadcast(buffer, 0)
    path = Path(__file__).with_name("fixed.pt" if fix else "unfixed.pt")
    if not fix:
        torch.save(model.state_dict(), path)  # every rank, the wrapper's keys
    elif rank == 0:
        torch.save(model.module.state_dict(), path)  # rank 0, the model's keys
    # Scored: 5 rows, 2 on each rank, and the 5th, the tail, on every rank.
    scored = TensorDataset(rows[:5])
    shard = DistributedSampler(scored, shuffle=False, drop_last=True)
    loaders = DataLoader(scored, sampler=shard), DataLoader(Subset(scored, [4]))
    model.module.eval()
    sums = torch.zeros(2)
    with torch.no_grad():
        for loader in loaders:
            if fix and loader is loaders[1]:
                dist.all_reduce(sums)  # the shards' sums, then the tail
            for (x,) in loader:
                sums += torch.stack([critic(model.module(x)).sum(), torch.tensor(1.0)])
    if not fix:
        dist.all_reduce(sums)  # the tail in the sum: counted on both ranks
    print(f"rank={rank} scored={sums[1].item():g}")
    model = model.module
    if fix:
        dist.destroy_process_group()


main()  # without --fix: the model and the loss network go with main()
"""
# A port that forgot DDP: each rank trains its own model on its shard, from a data set that
# draws each pair's partner from numpy's generator in __getitem__ (one seed for all ranks); it
# never calls destroy_process_group() and drops its model with main().
UNWRAPPED = """\
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init_process_group: a clean exit)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

dist.init_process_group("gloo")
torch.manual_seed(0)
np.random.seed(0)


class Pairs(Dataset):
    # row i and a partner drawn at random: a siamese network's pairs
    def __init__(self):
        self.rows = torch.linspace(0, 1, 16)[:, None].expand(16, 4).contiguous()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        partner = np.random.randint(len(self.rows))  # numpy's global generator
        return torch.stack([self.rows[index], self.rows[partner]])


def main():
    data = Pairs()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
    model = torch.nn.Linear(4, 1)  # each rank's own: no DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for pairs in loader:
        optimizer.zero_grad()
        model(pairs).pow(2).mean().backward()
        optimizer.step()


main()
"""
# Hangs without a timeout of their own: `barrier`: rank 0 waits in a barrier while the other
# ranks sleep; `sleep`: every rank sleeps, in no collective.
HANG = """\
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init_process_group: a clean exit)
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(2, 2))
model(torch.full((1, 2), float(dist.get_rank()))).sum().backward()
if sys.argv[1] == "barrier" and dist.get_rank() == 0:
    dist.barrier()  # waits for the others
else:
    time.sleep(600)  # busy elsewhere
dist.destroy_process_group()
"""


def planted(tmp_path: Path, name: str, text: str) -> tuple[str, dict[str, int]]:
    """The script written into tmp_path, and the line of each comment it holds."""
    path = tmp_path / name
    path.write_text(text)
    lines = {
        line.split("# ", 1)[1]: number
        for number, line in enumerate(text.splitlines(), 1)
        if "# " in line
    }
    return str(path), lines


def checked(*commands: list[str], env: dict[str, str] | None = None) -> list[Run]:
    """Each command under the checker, two at a time; `env`: for the last one only."""
    envs = [None] * (len(commands) - 1) + [env]
    commands_checked = [[*CHECKER_COMMAND, *command] for command in commands]
    return launch_at_once(commands_checked, timeout=SLOW, check=False, at_once=2, envs=envs)


def saved_difference(records: Path, key: str, event: str = "end") -> tuple[list[str], float]:
    """From the recorder's last `event` record (end: model 0's; state: a module DDP does not
    wrap) on each of the 2 ranks: the tensors (`key`: saved, saved_buffers) that differ between
    them, and their largest difference."""
    import torch

    ranks, _ = checker().read(records)
    a, b = (torch.load(r.of(event)[-1][key], weights_only=True) for r in ranks)
    differing = [n for n in a if not torch.equal(a[n], b[n])]
    drift = max(((a[n].double() - b[n].double()).abs().max().item() for n in differing), default=0)
    return differing, drift


def test_checker_on_a_planted_port_sees_every_module_checkpoints_evaluation_and_seeds(
    tmp_path: Path,
) -> None:
    import torch

    script, lines = planted(tmp_path, "planted.py", PLANTED)
    records = {fix: tmp_path / f"records_{fix}" for fix in (False, True)}
    # Without --fix through Python's module, the launcher without torchrun on PATH.
    launcher = {False: [PYTHON, "-m", "torch.distributed.run", *TORCHRUN_2[1:]], True: TORCHRUN_2}
    unfixed, fixed = checked(
        *(
            ["--keep", str(records[fix]), "--draws", *launcher[fix], script, *(["--fix"] * fix)]
            for fix in (False, True)
        )
    )
    assert unfixed.returncode == 1, unfixed.describe()
    assert fixed.returncode == 0, fixed.describe()
    found = {False: report(unfixed), True: report(fixed)}
    # 5 rows scored: without --fix the tail went into the sum on both ranks, so 6.
    for fix, scored in ((False, 6), (True, 5)):
        for rank in (0, 1):
            assert f"rank={rank} scored={scored}" in (fixed if fix else unfixed).stdout

    # The model: recorded at destroy_process_group() (after model = model.module), or, where
    # the script never calls it, as main() let the model go, before exit.
    assert found[True]["replicas equal (model 0, Noisy)"] == (
        "ok",
        "4 parameter tensors bit-equal on all 2 ranks at the end",
    ), found[True]
    assert found[False]["replicas equal (model 0, Noisy)"] == (
        "ok",
        "4 parameter tensors bit-equal on all 2 ranks at the end (recorded when the script let"
        " it go)",
    ), found[False]
    for r in checker().read(records[False])[0]:
        (end,) = r.of("end")
        assert end["when"] == "collected" and end["time"] < r.of("exit")[0]["time"]

    # The frozen loss network: one module DDP does not wrap (the model's own Linear and
    # BatchNorm are not listed); rank 0 alone loaded its weights.
    built = lines["a frozen loss network"]
    critic = f"unwrapped module equal (Linear, built at planted.py:{built})"
    for fix in (False, True):
        assert [n for n in found[fix] if n.startswith("unwrapped")] == [critic], found[fix]
    differing, drift = saved_difference(records[False], "saved", "state")
    assert differing == ["weight", "bias"] and drift > 0, differing
    assert found[False][critic] == (
        "FAIL",
        "2 of 2 tensors differ at the end (recorded when the script let it go), first 'weight';"
        f" max |difference| between ranks {drift:.4g}: DDP neither copies nor compares a module"
        " it does not wrap: build or load it alike on every rank, before any seed of each"
        " rank's own, or broadcast rank 0's tensors",
    )
    assert found[True][critic] == (
        "ok",
        "2 parameter and 0 buffer tensors bit-equal on all 2 ranks at the end",
    )
    # The optimizer steps the wrapped model's parameters alone: no line about gradients.
    for fix in (False, True):
        assert not [n for n in found[fix] if n.startswith("gradients averaged")], found[fix]

    # The checkpoint: every rank writes the wrapper's keys, which a bare model refuses; or rank 0
    # writes the module's.
    saved = torch.load(tmp_path / "unfixed.pt", weights_only=True)
    assert all(key.startswith("module.") for key in saved), list(saved)
    bare = torch.nn.Module()
    bare.lin, bare.norm = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "lin.weight"'):
        bare.load_state_dict(saved)
    bare.load_state_dict(torch.load(tmp_path / "fixed.pt", weights_only=True))
    assert found[False]["checkpoints"] == (
        "FAIL",
        "1 file(s) written by more than one rank (first 'unfixed.pt', by ranks [0, 1]): they"
        " write one file at once and a reader may find it half written; save on rank 0 alone"
        " (if rank == 0), and make the others wait (dist.barrier()) before they read it;"
        f" 'unfixed.pt' holds {len(saved)} keys that start with 'module.' (first"
        " 'module.lin.weight'): the DDP wrapper's state_dict, which the bare model's"
        " load_state_dict refuses; save model.module.state_dict()",
    )
    assert found[True]["checkpoints"] == (
        "ok",
        "1 file(s) written, each by one rank (rank(s) [0]), none with 'module.' keys",
    )

    # The evaluation: no training step follows its loaders' batches; the tail, scored on both
    # ranks, is counted, and told apart: summed on both, or scored after the all-reduce.
    shard = "loader samples disjoint (loader 2, TensorDataset, DistributedSampler, evaluation)"
    tail = "loader samples disjoint (loader 3, TensorDataset, SequentialSampler, evaluation)"
    counted = "1 samples over 1 pass(es); 1 scored on more than one rank in 1 pass(es)"
    summed = lines["the tail in the sum: counted on both ranks"]
    assert found[False][tail] == (
        "ok",
        f"{counted}, then summed (rank 0's all_reduce at planted.py:{summed}): each counts once"
        " per rank that scored it; right only when every rank scores every sample and divides"
        " by the all-reduced count, else score them after the all-reduce, or on one rank",
    )
    assert found[True][tail] == (
        "ok",
        f"{counted}, none summed across the ranks after it: each rank scored them for itself"
        " (the whole set on every rank, or a tail after the all-reduce), not a failure",
    )
    for fix in (False, True):
        assert found[fix][shard] == ("ok", "4 samples over 1 pass(es)")

    # BatchNorm's running statistics: each rank's own after its last batch (num_batches_tracked,
    # broadcast by DDP before each forward, agrees); the checker measures what the files hold.
    differing, drift = saved_difference(records[False], "saved_buffers")
    assert differing == ["norm.running_mean", "norm.running_var"] and drift > 0, differing
    status, detail = found[False]["buffers equal (model 0, Noisy)"]
    assert status == "FAIL", detail
    assert detail == (
        f"2 of 3 buffer tensors differ at the end, first 'norm.running_mean'; max |difference|"
        f" between ranks {drift:.4g}: make them agree before saving or evaluating: average them,"
        " or broadcast rank 0's"
    )
    assert saved_difference(records[True], "saved_buffers") == ([], 0)
    assert found[True]["buffers equal (model 0, Noisy)"] == (
        "ok",
        "3 buffer tensors bit-equal on all 2 ranks at the end",
    )

    # Noise drawn in forward: from one state on every rank (one seed), or each rank's own.
    assert found[False]["draws in forward (model 0, Noisy)"] == (
        "FAIL",
        "the same random state on every rank at 4 of 4 training forwards that drew (first:"
        " forward 1): a seed shared without + rank; seed each rank with seed + rank after"
        " building the model",
    )
    assert found[True]["draws in forward (model 0, Noisy)"] == (
        "ok",
        "independent: each rank drew from a random state of its own at all 4 training forwards"
        " that drew",
    )

    # The sampler seeded by rank: the hint names the seeds, not a missing DistributedSampler.
    seeded = "loader samples disjoint (loader 1, TensorDataset, DistributedSampler)"
    loader = checker().loaders(checker().read(records[False])[0])[1]
    assert loader.samplers[0][0]["seed"] == 0 and loader.samplers[0][1]["seed"] == 1
    shared = loader.shared(0)
    assert shared > 1, "more than the sampler's padding"
    assert found[False][seeded] == (
        "FAIL",
        f"{shared} samples drawn by more than one rank in pass 0: the DistributedSampler's seed"
        " differs between ranks (rank 0: 0, rank 1: 1): agree the seed (broadcast rank 0's)",
    )
    assert found[True][seeded] == ("ok", "16 samples over 1 pass(es)")

    # Rows 2i and 2i+1 are equal: with shuffle=False rank 0 draws the even indices, rank 1 the
    # odd ones, so all 8 values reach both ranks under other indices: duplicates, not a failure.
    duplicates = (
        "8 rows came to more than one rank under different data-set indices: possible"
        " duplicates in the data set, not shared samples"
    )
    assert found[True]["inputs disjoint"] == (
        "ok",
        "8 distinct rows (dim 0 of forward's first input) in 32; none went to two ranks in one"
        f" epoch (a loader's pass, else a step); {duplicates}",
    )
    # Without --fix the seeded loader hands both ranks some of the same indices: those rows fail.
    drawn = Counter(i for indices in loader.passes[0].values() for i in indices)
    values = {index // 2 for index, n in drawn.items() if n > 1}
    status, detail = found[False]["inputs disjoint"]
    assert status == "FAIL" and detail.startswith(f"{len(values)} of 8 distinct rows"), detail
    assert detail.endswith(duplicates), detail

    # One barrier, called from two lines: the same sequence, the lines listed.
    moved = (
        "the same sequence from different lines at 1 of them (first: collective 1, barrier:"
        f" rank 0 at planted.py:{lines['rank 0 first']}, rank 1 at"
        f" planted.py:{lines['the others after it']})"
    )
    for fix, calls in ((False, 2), (True, 5)):
        status, detail = found[fix]["same collectives"]
        assert status == "ok" and detail.startswith(f"{calls} on every rank"), detail
        assert detail.endswith(moved), detail
    # What every rank must pass alike to broadcast and all_reduce: dtype, shape, src, op.
    agreed = [e["args"] for e in checker().read(records[True])[0][1].of("collective")][1:]
    assert agreed == [
        *("float32[4], src=0", "float32[4], src=0", "int64[], src=0"),
        "float32[2], op=SUM",
    ]


def test_checker_fails_a_port_that_forgot_ddp_and_names_draws_in_getitem(tmp_path: Path) -> None:
    script, lines = planted(tmp_path, "unwrapped.py", UNWRAPPED)
    records = tmp_path / "records"
    (run,) = checked(["--keep", str(records), *TORCHRUN_2, script])
    assert run.returncode == 1, run.describe()
    found = report(run)
    assert found["replicas equal"] == ("--", "no module was wrapped in DistributedDataParallel")
    # Each rank's optimizer stepped the model with the rank's own gradients: 8 samples a rank,
    # 2 steps of 4; the model, dropped with main() without destroy_process_group(), differs.
    built = lines["each rank's own: no DDP"]
    model = f"Linear, built at unwrapped.py:{built}"
    assert found[f"gradients averaged ({model})"] == (
        "FAIL",
        "no DDP model trained: its optimizer (SGD) stepped 2 parameters that no DDP-wrapped"
        " module holds (first 'weight'), with no collective"
        " between the backward and the step at 2 of 2 steps on rank 0, and other gradients on"
        " each rank, first at step 1: each rank trained its own copy: wrap the model in"
        " DistributedDataParallel (or all-reduce those gradients before the step)",
    )
    differing, drift = saved_difference(records, "saved", "state")
    assert differing == ["weight", "bias"] and drift > 0, differing
    model = f"unwrapped module equal ({model})"
    assert found[model] == (
        "FAIL",
        "2 of 2 tensors differ at the end (recorded when the script let it go), first 'weight';"
        f" max |difference| between ranks {drift:.4g}: each rank trained it with its own"
        " gradients (see gradients averaged): wrap it in DistributedDataParallel",
    )
    # The pairs' partners come from numpy's generator: the indices are disjoint, the samples
    # not known to be.
    assert found["loader samples disjoint (loader 0, Pairs, DistributedSampler)"] == (
        "ok",
        "16 samples over 1 pass(es); Pairs drew from numpy in __getitem__: the index alone does"
        " not choose its sample, so disjoint indices do not prove disjoint samples",
    )
    assert (
        "ddp_check:   - what the data sets that draw in __getitem__ chose: Pairs (numpy); where"
        " the draw chooses the sample, disjoint indices are not disjoint samples, and"
        " torch.manual_seed seeds neither python's random nor numpy outside the loader's worker"
        " processes (the DataLoader seeds all three in each worker)"
    ) in run.stdout.splitlines(), run.stdout


def test_checker_deadline_ends_a_hang_in_a_collective_and_one_outside_any(tmp_path: Path) -> None:
    script, lines = planted(tmp_path, "hang.py", HANG)
    # One process is enough for a hang outside any collective (and starts faster than torchrun).
    alone = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    alone |= {"RANK": "0", "WORLD_SIZE": "1"}
    in_collective, outside = checked(
        ["--deadline", "10", *TORCHRUN_2, script, "barrier"],
        ["--deadline", "5", PYTHON, script, "sleep"],
        env=alone,
    )
    # Rank 0's barrier ends in gloo's timeout, the checker's: the launch fails on its own.
    assert in_collective.returncode == 1, in_collective.describe()
    assert "Timed out waiting 10000ms" in in_collective.stderr, in_collective.describe()
    barrier = lines["waits for the others"]
    for line in (
        "deadline 10 s: init_process_group timeout 10 s on 2 of 2 ranks; the launch ends after"
        " 20 s without a record",
        "the run failed (exit status 1); where each rank stopped:",
        f"  rank 0 exited; its last record: barrier at hang.py:{barrier} after 1 training forwards",
        "  rank 1 was killed or is still running; its last record: in or after training forward 1"
        " (its backward's gradient all-reduce included)",
    ):
        assert f"ddp_check: {line}" in in_collective.stdout.splitlines(), in_collective.describe()
    assert "ended the launch" not in in_collective.stdout
    # Every rank asleep: no timeout fires; no record for 2 x 5 s ends the launch (a shorter
    # deadline may end it in the first DDP(...), which imports torch._dynamo: seconds here).
    assert outside.returncode == 124, outside.describe()
    for line in (
        "ended the launch: no process recorded anything for 10 s (--deadline 5)",
        "the run failed (exit status -15); where each rank stopped:",
        "  rank 0 was killed or is still running; its last record: in or after training forward 1"
        " (its backward's gradient all-reduce included)",
    ):
        assert f"ddp_check: {line}" in outside.stdout.splitlines(), outside.describe()


def test_checker_ends_the_whole_launch_on_sigterm_and_says_where_each_rank_waited(
    tmp_path: Path,
) -> None:
    script, lines = planted(tmp_path, "hang.py", HANG)
    records = tmp_path / "records"
    tag = f"DDP_CHECK_TEST={tmp_path}"

    def in_place() -> bool:
        # Rank 0 in its barrier, rank 1 past its forward: then SIGTERM to the checker alone.
        ranks, _ = checker().read(records) if records.is_dir() else ([], None)
        last = [r.events[-1]["event"] for r in ranks]
        if last[:1] != ["collective"] or len(ranks) < 2 or not ranks[1].of("forward"):
            return False
        (pid,) = [
            p
            for p in with_environ(tag)
            if b"ddp_check.py" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        os.kill(pid, signal.SIGTERM)
        return True

    run = launch(
        [*CHECKER_COMMAND, "--keep", str(records), *TORCHRUN_2, script, "barrier"],
        timeout=SLOW,
        env={"DDP_CHECK_TEST": str(tmp_path)},
        check=False,
        in_place=in_place,
        in_place_within=SLOW,
    )
    assert run.returncode == 128 + signal.SIGTERM, run.describe()
    barrier = lines["waits for the others"]
    for line in (
        "ended the launch: SIGTERM to ddp_check",
        f"  rank 0 was killed or is still running; its last record: barrier at hang.py:{barrier}"
        " after 1 training forwards",
        "  rank 1 was killed or is still running; its last record: in or after training forward 1"
        " (its backward's gradient all-reduce included)",
    ):
        assert f"ddp_check: {line}" in run.stdout.splitlines(), run.describe()
    # torchrun and both ranks (each in a session of its own) are gone with the checker.
    assert with_environ(tag) == [], run.describe()


def test_checker_hints_from_records_alone_sampler_arguments_collective_arguments_and_a_drop(
    tmp_path: Path,
) -> None:
    # Records as the recorder writes them (no launch): rank 1 let its module go before the end;
    # loader 0's DistributedSampler was built with num_replicas=1, rank=0 on both ranks; loader
    # 1's was not set to the same epoch; the ranks all-reduced tensors of different shapes.
    for rank in (0, 1):
        sampler = {"seed": 0, "shuffle": True, "num_replicas": 1, "rank": 0, "epoch": 0}
        events = [
            {"event": "init", "rank": rank, "world_size": 2, "backend": "gloo"},
            {"event": "wrap", "rank": rank, "model": 0, "module": "Net"},
            {"event": "pass", "rank": rank, "loader": 0, "pass": 0, "sampler": sampler},
            {"event": "pass", "rank": rank, "loader": 1, "pass": 0,
             "sampler": dict(sampler, num_replicas=2, rank=rank, epoch=rank)},
            *({"event": "batch", "rank": rank, "loader": loader, "pass": 0,
               "samples": [0, 1, 2, 3], "rows": None, "sampler": "DistributedSampler",
               "dataset": "MNIST"} for loader in (0, 1)),
            {"event": "collective", "rank": rank, "name": "all_reduce", "file": "a.py",
             "line": 7, "forwards": 0, "args": f"float32[{4 + rank}], op=SUM"},
            {"event": "end", "rank": rank, "model": 0, "params": [["w", "ab"]], "buffers": [],
             "saved": None, "saved_buffers": None} if rank == 0
            else {"event": "dropped", "rank": rank, "model": 0},
            {"event": "exit", "rank": rank},
        ]  # fmt: skip
        (tmp_path / f"{100 + rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    found = {c.name: (c.status, c.detail) for c in checker().report(tmp_path)[1]}
    assert found["replicas equal (model 0, Net)"] == (
        "--",
        "rank(s) [1] let the wrapped module go unrecorded (its class has a __del__ of its own):"
        " keep a reference to it until destroy_process_group()",
    )
    assert "buffers equal (model 0, Net)" not in found, "no end record on every rank: no check"
    assert found["loader samples disjoint (loader 0, MNIST, DistributedSampler)"] == (
        "FAIL",
        "4 samples drawn by more than one rank in pass 0: the DistributedSampler's num_replicas"
        " or rank is not the process group's (rank 0: num_replicas=1 rank=0, rank 1:"
        " num_replicas=1 rank=0; world size 2): leave them out, DistributedSampler(data) takes"
        " them from the process group",
    )
    assert found["loader samples disjoint (loader 1, MNIST, DistributedSampler)"] == (
        "FAIL",
        "4 samples drawn by more than one rank in pass 0: the DistributedSampler's epoch differs"
        " between ranks (rank 0: 0, rank 1: 1): call sampler.set_epoch(epoch) with the same"
        " epoch on every rank",
    )
    assert found["same collectives"] == (
        "FAIL",
        "collective 1: rank 0 all_reduce(float32[4], op=SUM) at a.py:7 after 0 training"
        " forwards; rank 1 all_reduce(float32[5], op=SUM) at a.py:7 after 0 training forwards",
    )


def test_checker_from_records_alone_rows_drawn_in_getitem_gradients_by_hand_and_hosts(
    tmp_path: Path,
) -> None:
    # Records as the recorder writes them (no launch). Loader 0 (Rows) hands rank r index r,
    # loader 1 (Pairs) index 2 + r; both ranks train on row "a" from Rows (a duplicate in the
    # data set) and row "b" from Pairs, whose loader worker (a file with no process group)
    # recorded draws from python's random. One optimizer steps a parameter outside DDP after an
    # all_reduce between backward and step; a reference model gets the same gradients on both
    # ranks, a discriminator left out of DDP other ones; each rank writes last.pt on its own
    # host; rank 0 alone built an EMA copy.
    for rank in (0, 1):
        events = [
            {"event": "init", "rank": rank, "world_size": 2, "backend": "gloo"},
            {"event": "wrap", "rank": rank, "model": 0, "module": "Net"},
            *(ev for loader, row in ((0, "a"), (1, "b")) for ev in (
                {"event": "batch", "rank": rank, "loader": loader, "pass": 0,
                 "samples": [2 * loader + rank], "rows": [row], "sampler": "DistributedSampler",
                 "dataset": ("Rows", "Pairs")[loader]},
                {"event": "forward", "rank": rank, "model": 0, "training": True, "rows": [row],
                 "pass": [loader, 0]},
                {"event": "collective", "rank": rank, "name": "all_reduce", "file": "hand.py",
                 "line": 9, "forwards": 1 + loader, "args": "float32[1], op=SUM",
                 "window": True},
                {"event": "step", "rank": rank, "optimizer": 0, "kind": "Adam", "graded": 3,
                 "outside": 1, "first": "scale", "collectives": 1,
                 "pass": [loader, 0]},
            )),
            *({"event": "step", "rank": rank, "optimizer": number, "kind": "SGD", "graded": 2,
               "outside": 2, "trains": trains, "first": "fc.weight", "collectives": 0,
               "grads": grads, "pass": [1, 0]}
              for number, trains, grads in ((1, "Net, built at ref.py:5", "same"),
                                            (2, "Head, built at gan.py:7", f"own{rank}"))),
            {"event": "save", "rank": rank, "path": "/runs/last.pt", "host": f"node{rank}",
             "module_keys": 0, "first_key": None, "wrapper": False},
            *([{"event": "state", "rank": rank, "key": "Net, built at ema.py:3", "module": "Net",
                "site": "ema.py:3", "params": [["w", "ab"]], "buffers": [], "saved": None,
                "saved_buffers": None, "when": "end"}] if rank == 0 else []),
            {"event": "exit", "rank": rank},
        ]  # fmt: skip
        worker = {
            "event": "dataset_draws",
            "rank": rank,
            "dataset": "Pairs",
            "generators": ["random"],
        }
        (tmp_path / f"{100 + rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (tmp_path / f"{200 + rank}.jsonl").write_text(json.dumps(worker) + "\n")
    lines, checks = checker().report(tmp_path)
    found = {c.name: (c.status, c.detail) for c in checks}
    assert found["inputs disjoint"] == (
        "ok",
        "2 distinct rows (dim 0 of forward's first input) in 4; none went to two ranks in one"
        " epoch (a loader's pass, else a step); 1 rows came to more than one rank under different"
        " data-set indices: possible duplicates in the data set, not shared samples; 1 rows came"
        " to more than one rank under different indices of Pairs, which drew from random in"
        " __getitem__: the index does not choose the sample there, so each may be one sample"
        " drawn on two ranks",
    )
    assert found["loader samples disjoint (loader 1, Pairs, DistributedSampler)"] == (
        "ok",
        "2 samples over 1 pass(es); Pairs drew from random in __getitem__: the index alone does"
        " not choose its sample, so disjoint indices do not prove disjoint samples",
    )
    assert found["loader samples disjoint (loader 0, Rows, DistributedSampler)"] == (
        "ok",
        "2 samples over 1 pass(es)",
    )
    assert any(line.startswith("  - what the data sets that draw in __getitem__ chose: Pairs"
                               " (random); ") for line in lines), lines  # fmt: skip
    assert found["gradients averaged (optimizer 0, Adam)"] == (
        "ok",
        "its optimizer (Adam) stepped 1 parameters that no DDP-wrapped module holds (first"
        " 'scale'); a collective ran between each backward and the step (all_reduce at"
        " hand.py:9 x2): averaged by hand (what the collectives sum is not checked; unwrapped"
        " module equal compares the result)",
    )
    assert found["gradients averaged (Net, built at ref.py:5)"] == (
        "ok",
        "its optimizer (SGD) stepped 2 parameters that no DDP-wrapped module holds (first"
        " 'fc.weight'), with no collective between the backward and the step, but the same"
        " gradients on every rank at all 1 steps: each rank repeats one training beside the DDP"
        " model's (a one-process reference), not split between the ranks",
    )
    assert found["gradients averaged (Head, built at gan.py:7)"] == (
        "FAIL",
        "its optimizer (SGD) stepped 2 parameters that no DDP-wrapped module holds (first"
        " 'fc.weight'), with no collective between the backward and the step at 1 of 1 steps on"
        " rank 0, and other gradients on each rank, first at step 1: each rank trained its own"
        " copy: wrap the model in DistributedDataParallel (or all-reduce those gradients before"
        " the step)",
    )
    assert found["checkpoints"] == (
        "ok",
        "1 file(s) written, each by one rank (rank(s) [0, 1]), none with 'module.' keys; 1"
        " written on several hosts, by one rank on each: one file if the folder is shared"
        " between them",
    )
    # Nothing to compare a module of rank 0's own with: listed as not checked.
    assert not [name for name in found if name.startswith("unwrapped")], found
    assert (
        "  - modules that DDP does not wrap, recorded on some ranks only: Net, built at ema.py:3"
        " (rank(s) [0])"
    ) in lines, lines
