"""The errors chapter (part4_torchrun/errors/): each script runs under its launcher without its
fix, where it fails (or hangs until its own collective timeout ends it) with the message the
troubleshooting page indexes, and with its fix, where it passes and its numbers are checked.
Every message in the page's index is asserted against a real run of the script it links to.

All launches run once, a few at a time (a module fixture): a hang mostly waits, and the scripts
fork their two ranks from a parent that imported torch. That parent is forked in turn from one
that imported torch once for all of them (tests/warm_python.py): a launch costs its own work."""

from __future__ import annotations

import os
import re
import select
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, TORCHRUN, Run, import_script, kill_tree, launch, png_size

CHAPTER = "part4_torchrun/errors"
README = Path(CHAPTER) / "README.md"
# Seconds per launch, a hang detector: a failing run ends on its own collective timeout (5 s,
# the scripts' default), a healthy one within seconds.
TIMEOUT = 120
# Launches at a time: the hangs wait, the others compute on the 2 cores.
PARALLEL = 4
TORCHRUN_2 = [TORCHRUN, "--standalone", "--nproc_per_node=2"]
TIMED_OUT = "Timed out waiting 5000ms for recv operation to complete"


WARM = [PYTHON, "tests/warm_python.py"]


def script(name: str, *args: str) -> list[str]:
    """`python SCRIPT ARGS`, forked from the warm interpreter (SOCKET: `runs` puts its socket's
    path there)."""
    return [*WARM, "run", "SOCKET", f"{CHAPTER}/{name}", *args]


# name: (command, extra environment); the hangs first, so that their waits overlap the rest.
# The hang writes each rank's Flight Recorder into FR_DUMP (`runs` puts a folder's path there):
# the flag acts only once a collective has failed, the timeout's output stays the learner's.
LAUNCHES: dict[str, tuple[list[str], dict[str, str]]] = {
    "hang": ([*TORCHRUN_2, f"{CHAPTER}/hang.py", "--fr-dump", "FR_DUMP"], {}),
    "rank0_slow": (script("rank0_slow.py"), {}),
    "uneven": (script("uneven_inputs.py"), {}),
    "hang_detail": (
        [*TORCHRUN_2, f"{CHAPTER}/hang.py"],
        {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    ),
    "rank0_slow_fix": (script("rank0_slow.py", "--fix"), {}),
    "hang_fix": ([*TORCHRUN_2, f"{CHAPTER}/hang.py", "--fix"], {}),
    "uneven_sampler": (script("uneven_inputs.py", "--fix", "sampler"), {}),
    "uneven_join": (script("uneven_inputs.py", "--fix", "join"), {}),
    "unused": (script("unused_parameters.py"), {}),
    "unused_find": (script("unused_parameters.py", "--fix", "find-unused"), {}),
    "unused_freeze": (script("unused_parameters.py", "--fix", "freeze"), {}),
    "twice": (script("checkpoint_twice.py"), {}),
    "twice_non_reentrant": (script("checkpoint_twice.py", "--fix", "non-reentrant"), {}),
    "twice_static": (script("checkpoint_twice.py", "--fix", "static-graph"), {}),
    "compile": (script("compile_order.py"), {}),
    "compile_inner": (script("compile_order.py", "--fix", "compile-inner"), {}),
    "compile_wrap": (script("compile_order.py", "--fix", "wrap-then-compile"), {}),
    "load": (script("load_every_rank.py"), {}),
    "load_fix": (script("load_every_rank.py", "--fix"), {}),
    "random": (script("random_state.py"), {}),
    "random_fix": (script("random_state.py", "--fix"), {}),
    "batchnorm": (script("batchnorm.py"), {}),
    "batchnorm_fix": (script("batchnorm.py", "--fix"), {}),
    # One short round of each set-up: the lines and the warning, no timing.
    "benchmark": (
        script("benchmark.py", "--no-compile", "--steps", "1", "--repeats", "1"),
        {},
    ),
}


# One thread per rank: two ranks on two cores, several launches at once.
THREADS = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def fr_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where the hang's ranks write their Flight Recorder."""
    return tmp_path_factory.mktemp("fr") / "hang"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, fr_dump: Path) -> dict[str, Run]:
    path = str(tmp_path_factory.mktemp("warm") / "socket")
    places = {"SOCKET": path, "FR_DUMP": str(fr_dump)}
    server = subprocess.Popen(
        [*WARM, "serve", path],
        cwd=REPO,
        env={**os.environ, **THREADS, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def one(name: str) -> Run:
        command, env = LAUNCHES[name]
        command = [places.get(word, word) for word in command]
        return launch(command, timeout=TIMEOUT, env={**THREADS, **env}, check=False)

    try:
        # It prints "ready" once it imported torch and listens (seconds); a start-up that
        # hangs ends the test here, not at pytest-timeout's last resort.
        ready, _, _ = select.select([server.stdout], [], [], TIMEOUT)
        line = server.stdout.readline() if ready else "(nothing)"
        assert line == "ready\n", f"the warm interpreter did not start within {TIMEOUT} s: {line}"
        with ThreadPoolExecutor(PARALLEL) as pool:
            futures = {name: pool.submit(one, name) for name in LAUNCHES}
            return {name: future.result() for name, future in futures.items()}
    finally:
        kill_tree(server.pid)
        server.wait()


def output(run: Run) -> str:
    return run.stdout + run.stderr


def failed_with(run: Run, *messages: str) -> None:
    """The run ended on its own (its collective timeout, not the test's), non-zero, with each
    message in its output."""
    assert run.returncode != 0 and not run.timed_out, run.describe()
    for message in messages:
        assert message in output(run), f"{message!r} missing\n{run.describe()}"


def passed(run: Run) -> str:
    assert run.returncode == 0, run.describe()
    return run.stdout


def values(stdout: str, kind: str) -> list[dict[str, str]]:
    """The key=value pairs of each stdout line that starts with `kind `."""
    lines = [line for line in stdout.splitlines() if line.startswith(kind + " ")]
    rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]
    assert rows, f"no '{kind}' line in:\n{stdout}"
    return rows


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+/\d+ loss=(\S+)$", stdout, re.MULTILINE)


def test_unused_parameters_fail_then_both_fixes_train_alike(runs: dict[str, Run]) -> None:
    failed_with(
        runs["unused"],
        "Expected to have finished reduction in the prior iteration before starting a new one",
    )
    # The auxiliary head's weight and bias are parameters 4 and 5 (after body and head); the
    # rank that reports first varies.
    assert re.search(r"did not receive grad for rank \d: 4 5", output(runs["unused"]))
    find, freeze = passed(runs["unused_find"]), passed(runs["unused_freeze"])
    assert len(losses(find)) == 3 and losses(find) == losses(freeze), "the same training"
    (done_find,), (done_freeze,) = values(find, "done"), values(freeze, "done")
    # DDP reduces all 6 tensors with the search, the 4 that train once the head is frozen.
    assert (done_find["reduced_tensors"], done_freeze["reduced_tensors"]) == ("6", "4")
    assert done_find["ranks_equal"] == done_freeze["ranks_equal"] == "True"


def test_reentrant_checkpoint_twice_fails_then_both_fixes_train_alike(
    runs: dict[str, Run],
) -> None:
    failed_with(
        runs["twice"],
        "Expected to mark a variable ready only once",
        "has been marked as ready twice",
    )
    non_reentrant, static = passed(runs["twice_non_reentrant"]), passed(runs["twice_static"])
    assert len(losses(static)) == 3 and losses(non_reentrant) == losses(static)
    for stdout in (non_reentrant, static):
        assert values(stdout, "done")[0]["ranks_equal"] == "True"


# Where each rank waits in hang.py: rank 0 in the all_reduce only it calls (the one under the
# bug's comment, not the fix's), rank 1 in the barrier.
WAITS = {
    0: ("all_reduce", "dist.all_reduce(counts)", "# The bug"),
    1: ("barrier", "dist.barrier()", ""),
}


def hang_line(rank: int) -> int:
    """The number of hang.py's line where this rank waits: its code, after that comment."""
    _, code, comment = WAITS[rank]
    lines = ["", *(REPO / CHAPTER / "hang.py").read_text().splitlines()]
    (number,) = [
        n for n in range(1, len(lines)) if lines[n].strip() == code and comment in lines[n - 1]
    ]
    return number


def test_hang_ends_on_the_timeout_with_each_rank_located(runs: dict[str, Run]) -> None:
    run = runs["hang"]
    failed_with(run, TIMED_OUT, "Root Cause (first observed failure)")
    # @record: torchrun's report holds the failed rank's traceback, down to the script's line
    # where it waited (rank 0 in the all_reduce, rank 1 in the barrier). Which rank it names
    # is the earlier failure, in whole seconds: either.
    root = run.stderr.split("Root Cause (first observed failure)", 1)[1]
    assert "error_file: <N/A>" not in root, run.describe()
    assert re.search(
        r'hang\.py", line \d+, in count_and_wait\n\s+dist\.(all_reduce\(counts\)|barrier\(\))',
        root,
    )
    (accuracy,) = values(passed(runs["hang_fix"]), "accuracy")
    # Both shards of 64 counted, by rank 0 alone.
    assert accuracy["total"] == "128" and 0 < int(accuracy["correct"]) < 128


def test_debug_detail_names_each_ranks_own_call_not_the_others(runs: dict[str, Run]) -> None:
    """DETAIL checks every collective first: a mismatch error instead of a wait. Each rank's
    message names its own call right and sits under its own traceback; the other rank's call
    it names is read from the length of that rank's fingerprint when the lengths differ:
    rank 0's all_reduce of one tensor of 1 dimension is 7 numbers (7: GATHER), rank 1's
    barrier 3 (3: REDUCE), as the page explains."""
    detail = runs["hang_detail"]
    failed_with(detail, "Detected mismatch between collectives on ranks")
    assert "Timed out" not in output(detail), "the mismatch is found before any timeout"
    own = {0: "SequenceNumber=0, OpType=ALLREDUCE", 1: "SequenceNumber=0OpType=BARRIER"}
    named = {0: "SequenceNumber=0OpType=REDUCE", 1: "SequenceNumber=0OpType=GATHER"}
    found = re.findall(
        r"^\[rank(\d)\]: RuntimeError: Detected mismatch between collectives on ranks\."
        r" Rank (\d) is running collective: CollectiveFingerPrint\(([^)]*)\),"
        r" but Rank (\d) is running collective: CollectiveFingerPrint\(([^)]*)\)",
        detail.stderr,
        re.MULTILINE,
    )
    assert found, detail.describe()
    for printer, rank, mine, other, theirs in found:
        rank, other = int(rank), int(other)
        assert int(printer) == rank and other == 1 - rank, detail.describe()
        assert mine.startswith(own[rank]), f"rank {rank}'s own call: {mine}"
        assert theirs == named[rank], f"rank {rank} reads rank {other}'s call as: {theirs}"
        # What the script called on the other rank is not what the message names.
        assert WAITS[other][0].upper().replace("_", "") not in theirs
    # Each rank's traceback ends in its own line of hang.py.
    for rank, (_, code, _) in WAITS.items():
        assert re.search(
            rf'^\[rank{rank}\]:   File "[^"]*hang\.py", line {hang_line(rank)}, in count_and_wait\n'
            rf"\[rank{rank}\]:     {re.escape(code)}$",
            detail.stderr,
            re.MULTILINE,
        ), detail.describe()


def draw_hang():
    """part4_torchrun/errors/figures/draw_hang.py, imported from its file."""
    return import_script(f"{CHAPTER}/figures/draw_hang.py")


def test_flight_recorder_records_gloo_and_the_figure_shows_the_hang(
    runs: dict[str, Run], fr_dump: Path, tmp_path: Path
) -> None:
    """Torch 2.15 records gloo's collectives by default: each rank of the hang writes its
    record when its collective fails (--fr-dump), and the figure's drawing script reads them.
    What its caption says: every rank at collective #1, each in another one, from its own line
    of hang.py, each waiting until the 5 s timeout."""
    run = runs["hang"]
    assert sorted(p.name for p in fr_dump.iterdir()) == ["rank_0", "rank_1"], run.describe()
    figure = draw_hang()
    data = figure.parse(fr_dump)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    printed = {int(v["rank"]): v for v in values(run.stdout, "flight_recorder")}
    for rank in data["ranks"]:
        op, code, _ = WAITS[rank["rank"]]
        # The script's one collective on each rank: all that the recorder holds.
        (last,) = rank["entries"]
        assert (last["op"], last["seq"], last["code"]) == (op, 1, code), last
        assert last["line"] == hang_line(rank["rank"]) and last["timeout_s"] == 5.0
        # The rank's own line, printed where it failed, says the same.
        assert printed[rank["rank"]] == {
            "rank": str(rank["rank"]),
            "last": f"gloo:{op}",
            "seq": "1",
            "line": str(last["line"]),
            "entries": "1",
        }
    # The ranks entered their collectives at about the same moment (one machine's clock).
    starts = [r["entries"][-1]["start_s"] for r in data["ranks"]]
    assert min(starts) == 0 and max(starts) < 1, starts
    out = tmp_path / "hang.png"
    figure.draw(data, out)
    assert png_size(out)[0] == 900 and 200 < png_size(out)[1] <= 550, png_size(out)


def test_rank0_slow_work_times_out_the_waiting_rank(runs: dict[str, Run]) -> None:
    # Rank 1 waits for rank 0's 7.5 s of evaluation and gives up after 5 s.
    failed_with(runs["rank0_slow"], TIMED_OUT, "Process 1 terminated with the following error")
    stdout = passed(runs["rank0_slow_fix"])
    epochs = values(stdout, "epoch")
    assert [e["val_samples"] for e in epochs] == ["64", "64"], "the whole set, shared"
    # Each rank evaluates half (3.75 s), within the 5 s timeout.
    assert all(float(e["eval_s"]) < 5 for e in epochs), stdout
    assert "done epochs=2" in stdout


def test_uneven_inputs_hang_then_sampler_or_join_end_the_epoch(runs: dict[str, Run]) -> None:
    failed_with(runs["uneven"], TIMED_OUT)
    (sampler,) = values(passed(runs["uneven_sampler"]), "done")
    (join,) = values(passed(runs["uneven_join"]), "done")
    # 36 samples either way: equal shards of 18 (5 batches each), or 20 and 16 (5 and 4).
    assert (sampler["batches"], sampler["samples"]) == ("5,5", "36")
    assert (join["batches"], join["samples"]) == ("5,4", "36")
    assert sampler["ranks_equal"] == join["ranks_equal"] == "True"


def test_loading_without_map_location_targets_gpu0_on_every_rank(runs: dict[str, Run]) -> None:
    broken = runs["load"]
    saved = values(broken.stdout, "saved")
    assert sorted((s["rank"], s["saved_on"]) for s in saved) == [("0", "cuda:0"), ("1", "cuda:0")]
    # What each rank's load without map_location allocates on GPU 0: the whole checkpoint,
    # nn.Linear(16, 4)'s 64 weights and 4 biases in float32.
    assert {s["bytes"] for s in saved} == {str(4 * (16 * 4 + 4))}
    if "loaded " in broken.stdout:
        # A machine with a GPU: every rank's copy lands on GPU 0.
        assert {r["device"] for r in values(broken.stdout, "loaded")} == {"cuda:0"}
    else:
        failed_with(
            broken,
            "Attempting to deserialize object on a CUDA device"
            " but torch.cuda.is_available() is False",
        )
    loaded = {r["rank"]: r for r in values(passed(runs["load_fix"]), "loaded")}
    assert sorted(loaded) == ["0", "1"] and all(r["equal"] == "True" for r in loaded.values())
    # map_location: each rank's own device (cpu here, cuda:1 for rank 1 on GPUs).
    assert loaded["1"]["device"] in ("cpu", "cuda:1")


def test_same_seed_same_augmentation_on_every_rank(runs: dict[str, Run]) -> None:
    for name, identical in (("random", "True"), ("random_fix", "False")):
        stdout = passed(runs[name])
        draws = [(a["flips"], a["shifts"]) for a in values(stdout, "augment")]
        (compare,) = values(stdout, "compare")
        assert compare["model_identical"] == "True", "the model starts the same either way"
        assert compare["augment_identical"] == identical
        assert (draws[0] == draws[1]) == (identical == "True")


def test_batchnorm_per_rank_statistics_and_syncbatchnorm_on_cpu(runs: dict[str, Run]) -> None:
    stdout = passed(runs["batchnorm"])
    bn = values(stdout, "bn")
    diffs = [float(b["mean_abs_diff"]) for b in bn]
    assert [b["per_rank_batch"] for b in bn] == ["2", "8", "32"]
    # Per-rank statistics miss the global ones, the more so the smaller the batch per rank.
    assert diffs == sorted(diffs, reverse=True) and diffs[-1] > 0.01, diffs
    (buffers,) = values(stdout, "buffers")
    # Each rank's running statistics drift apart; DDP puts rank 0's back at the next forward
    # through the wrapper, an evaluation's too (eval mode, no_grad) after a training forward.
    assert buffers == {"after_forward_equal": "False", "eval_forward_starts_from_rank0": "True"}
    # The fix on a CPU: SyncBatchNorm is refused.
    failed_with(runs["batchnorm_fix"], "SyncBatchNorm layers only work with GPU modules")


def test_torch_compile_before_ddp_prefixes_the_checkpoint(runs: dict[str, Run]) -> None:
    failed_with(runs["compile"], 'Unexpected key(s) in state_dict: "_orig_mod.layers.0.weight"')
    # 8 layers of 1 MB and 1 MB buckets: 8 buckets, and a graph for each, whichever the order;
    # but compiling the DDP module compiles nothing of a bare nn.Sequential.
    expected = {"compile": (8, 8), "compile_inner": (8, 8), "compile_wrap": (8, 0)}
    for name, (net, sequential) in expected.items():
        graphs = {g["model"]: int(g["graphs"]) for g in values(runs[name].stdout, "graphs")}
        assert graphs == {"Net": net, "Sequential": sequential}, runs[name].describe()
    for name in ("compile_inner", "compile_wrap"):
        (loaded,) = values(passed(runs[name]), "loaded")
        assert (loaded["keys"], loaded["first_key"]) == ("16", "layers.0.weight")


def test_benchmark_prints_a_ratio_per_setup(runs: dict[str, Run]) -> None:
    # A smoke run (--no-compile, one round of one step): the lines, not the timings.
    run = runs["benchmark"]
    lines = values(passed(run), "bench")
    settings = [line["setting"] for line in lines]
    assert len(settings) == 10 and "compile_inner" not in settings, settings
    assert {line["group"] for line in lines} == {"knobs", "large_batch", "small_batch"}
    for group in ("knobs", "large_batch", "small_batch"):
        first = next(line for line in lines if line["group"] == group)
        assert first["ratio"] == first["cpu_ratio"] == "1.00", "each group's first is its base"
    assert all(float(line["ms"]) > 0 and float(line["cpu_ms"]) > 0 for line in lines)
    assert "did not find any unused parameters in the forward pass" in run.stderr


def index_rows() -> list[tuple[str, str]]:
    """(message, script) of each row of the page's index: the message in backticks in the
    first cell, the script linked in the last."""
    text = (REPO / README).read_text()
    section = text.split("## Troubleshooting by error message", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 4:
            continue
        message = re.fullmatch(r"`(.+)`", cells[0])
        link = re.search(r"\]\(([\w.]+\.py)\)", cells[3])
        assert message and link, f"an index row without a message or script: {line}"
        rows.append((message.group(1), link.group(1)))
    return rows


def test_every_indexed_message_comes_from_its_script(runs: dict[str, Run]) -> None:
    rows = index_rows()
    assert len(rows) >= 8, rows
    for message, name in rows:
        outputs = [output(run) for run in runs.values() if f"{CHAPTER}/{name}" in run.command]
        assert outputs, f"no run of {name}"
        assert any(message in text for text in outputs), f"{message!r} not in any run of {name}"


def test_every_quoted_output_comes_from_a_run(runs: dict[str, Run]) -> None:
    """The page's ```text blocks quote PyTorch's messages: each piece between the elisions
    ([...] or ...) appears in a real run. The scripts' own key=value lines are left out (their
    numbers are measured here; the tests above check them)."""
    text = (REPO / README).read_text()
    # Blocks in a list item are indented.
    blocks = re.findall(r"^ *```text\n(.*?)^ *```", text, re.DOTALL | re.MULTILINE)
    everything = "".join(output(run) for run in runs.values())
    pieces = [
        piece.strip()
        for block in blocks
        for line in block.splitlines()
        if not re.fullmatch(r"\w+( \w+=\S+)+", line.strip())
        for piece in re.split(r"\[\.\.\.\]|\.\.\.", line)
    ]
    missing = [piece for piece in pieces if len(piece) >= 12 and piece not in everything]
    assert not missing, f"quoted on the page, printed by no run: {missing}"
