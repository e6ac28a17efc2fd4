"""Your own script, the classes that ported scripts bring (part4_torchrun/your_script/): a
library that decides from a rank's own value (closure.py), a module DDP does not wrap
(frozen_module.py), random draws inside a data set (pair_draws.py), a strided split that lines
up with the data (strided_split.py), the equivalence recipe's controls for BatchNorm and Adam
(equivalence.py --norm, --optimizer), and the replicas drifting apart step by step when ranks
decide alone (decisions.py --drift-every, its figure) with the signal list torchrun hands its
workers. Each runs without its fix (the failure, measured) and with it (the check passes).

All launches run once, a few at a time (a module fixture), under torchrun's own code with the
agent and the ranks forked from one interpreter that imported torch (conftest.warm_torchrun):
a launch costs its own work, not three imports of torch."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import (
    WARM_PYTHON,
    YOUR_SCRIPT,
    Run,
    assert_figure,
    import_script,
    launch,
    warm_interpreter,
    warm_torchrun,
)
from test_equivalence import at_rounding_after_one_step, diffs

# Seconds per launch; healthy ones take 2-10 s here, closure.py's hang its 5 s timeout more.
TIMEOUT = 180
# Launches at a time: the hang waits, the others compute on the 2 cores.
PARALLEL = 3
FIGURES = f"{YOUR_SCRIPT}/figures"
TORCHELASTIC = "TORCHELASTIC_SIGNALS_TO_HANDLE"

# name: (script, arguments, extra environment, ranks: 2 under torchrun, 1 under python)
LAUNCHES: dict[str, tuple[str, list[str], dict[str, str], int]] = {
    "closure": ("closure.py", ["--timeout", "5"], {}, 2),
    "closure_fix": ("closure.py", ["--fix"], {}, 2),
    "frozen": ("frozen_module.py", [], {}, 2),
    "frozen_fix": ("frozen_module.py", ["--fix"], {}, 2),
    "frozen_broadcast": ("frozen_module.py", ["--fix", "broadcast"], {}, 2),
    "pairs": ("pair_draws.py", [], {}, 2),
    "pairs_fix": ("pair_draws.py", ["--fix"], {}, 2),
    "strided": ("strided_split.py", [], {}, 2),
    "strided_fix": ("strided_split.py", ["--fix"], {}, 2),
    "strided_no_bn": ("strided_split.py", ["--no-batchnorm"], {}, 2),
    "bn": ("equivalence.py", ["--norm", "batch"], {}, 2),
    "bn_fix": ("equivalence.py", ["--norm", "batch", "--fix"], {}, 2),
    "bn_one": ("equivalence.py", ["--norm", "batch"], {}, 1),
    "adam": ("equivalence.py", ["--norm", "instance", "--optimizer", "adam"], {}, 2),
    "adam_one": ("equivalence.py", ["--norm", "instance", "--optimizer", "adam"], {}, 1),
    # The variable alone does not choose the signals: torchrun sets it from its own option.
    "drift": ("decisions.py", ["--drift-every", "1"], {TORCHELASTIC: "SIGTERM,SIGUSR1"}, 2),
    "drift_fix": (
        "decisions.py",
        ["--fix", "--drift-every", "1"],
        {TORCHELASTIC: "SIGTERM,SIGUSR1"},
        2,
    ),
    # --signals-to-handle, or its variable PET_SIGNALS_TO_HANDLE, does.
    "signals": (
        "decisions.py",
        ["--fix", "--epochs", "1"],
        {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1", TORCHELASTIC: "SIGHUP"},
        2,
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    with warm_interpreter(tmp_path_factory.mktemp("warm")) as socket:

        def one(name: str) -> Run:
            script, args, env, ranks = LAUNCHES[name]
            path = f"{YOUR_SCRIPT}/{script}"
            if ranks == 1:
                command = [*WARM_PYTHON, "run", socket, path, *args]
            else:
                command = warm_torchrun(socket, path, *args, nproc=ranks)
            return launch(command, timeout=TIMEOUT, env=env, check=False)

        with ThreadPoolExecutor(PARALLEL) as pool:
            futures = {name: pool.submit(one, name) for name in LAUNCHES}
            return {name: future.result() for name, future in futures.items()}


def passed(run: Run) -> str:
    assert run.returncode == 0, run.describe()
    return run.stdout


def one_value(run: Run, pattern: str) -> str:
    """The one match of `pattern` (one group) in the output."""
    found = re.findall(pattern, run.stdout, re.MULTILINE)
    assert len(found) == 1, f"{pattern!r}: {found}\n{run.describe()}"
    return found[0]


# ---- closure.py: LBFGS decides from the loss the closure returns ------------------------------

STEP = re.compile(
    r"^rank=(\d) step=(\d+) closure_calls=(\d+) loss=(\S+) weights_sum=(\S+)$", re.MULTILINE
)


def steps(run: Run) -> dict[int, dict[int, tuple[int, str, str]]]:
    """rank -> step -> (closure calls, loss, weights' sum), as printed."""
    found: dict[int, dict[int, tuple[int, str, str]]] = {0: {}, 1: {}}
    for rank, step, calls, loss, total in STEP.findall(run.stdout):
        found[int(rank)][int(step)] = (int(calls), loss, total)
    return found


def test_a_closure_returning_each_ranks_loss_splits_lbfgs_and_the_agreed_loss_does_not(
    runs: dict[str, Run],
) -> None:
    alone, agreed = runs["closure"], runs["closure_fix"]
    first = float(one_value(agreed, r"^one_process step=1 loss=(\S+)$"))
    # Without --fix: each rank's line search reads its own loss (at step 1 the two halves'
    # losses, whose mean is the original's): the weights part, then the calls, ...
    mine = steps(alone)
    assert mine[0][1][1] != mine[1][1][1], "each rank's own loss"
    mean = (float(mine[0][1][1]) + float(mine[1][1][1])) / 2
    assert abs(mean - first) < 1e-4 * first, (mean, first)
    both = sorted(set(mine[0]) & set(mine[1]))
    assert any(mine[0][s][2] != mine[1][s][2] for s in both), "the weights part"
    assert any(mine[0][s][0] != mine[1][s][0] for s in both), "then the closure calls"
    # ... and a rank waits for an all-reduce the other never makes: the run ends on the timeout.
    assert alone.returncode != 0 and not alone.timed_out, alone.describe()
    assert "Timed out waiting 5000ms" in alone.stderr, alone.describe()
    assert "replicas max_abs_diff" not in alone.stdout
    # With --fix: every rank reads the loss of all the rows, so the same calls and weights.
    passed(agreed)
    theirs = steps(agreed)
    assert sorted(theirs[0]) == sorted(theirs[1]) == list(range(1, 11)), agreed.describe()
    assert theirs[0] == theirs[1], "the same decisions, calls and weights on every rank"
    assert float(theirs[0][1][1]) == first, "the closure returns the original's loss"
    assert one_value(agreed, r"^replicas max_abs_diff=(\S+)$") == "0"


# ---- frozen_module.py: a frozen network DDP does not wrap -------------------------------------

REFUSAL = (
    "DDP(frozen) error=RuntimeError: DistributedDataParallel is not needed when a module doesn't"
    " have any parameter that requires a gradient."
)


def frozen_numbers(run: Run) -> tuple[float, float, dict[str, str], float]:
    """(frozen network's difference between ranks, student's, rank -> held-out loss as printed,
    difference from the one-process original)."""
    frozen = float(one_value(run, r"^frozen max_abs_diff=(\S+) "))
    student = float(one_value(run, r" student max_abs_diff=(\S+)$"))
    held = dict(re.findall(r"^rank=(\d) held_out_loss=(\S+)$", run.stdout, re.MULTILINE))
    original = float(one_value(run, r"^vs_one_process max_abs_diff=(\S+)$"))
    return frozen, student, held, original


def test_a_frozen_network_built_after_the_per_rank_seed_differs_and_the_check_finds_it(
    runs: dict[str, Run],
) -> None:
    alone = runs["frozen"]
    # DDP refuses the frozen network itself, and never copies or checks it.
    assert REFUSAL in alone.stdout.splitlines(), alone.describe()
    frozen, student, held, original = frozen_numbers(alone)
    # Each rank built its own: the student's replicas stay equal (DDP averages their
    # gradients), and each rank scores that one student against another network.
    assert frozen > 0.01 and student == 0, (frozen, student)
    assert sorted(held) == ["0", "1"] and held["0"] != held["1"], held
    assert original > 1e-3, "not the training of one process against rank 0's network"
    # The replica check of every module, wrapped or not, names the frozen one.
    assert alone.returncode != 0, alone.describe()
    check = "error: replicas differ at step 40: first differing tensor 'frozen.0.weight'"
    assert f"{check} (4 of 8 differ)" in alone.stderr.splitlines(), alone.describe()
    # Built before the per-rank seed, or broadcast from rank 0: one network, one loss, and the
    # original's training to rounding.
    for name in ("frozen_fix", "frozen_broadcast"):
        run = runs[name]
        passed(run)
        assert REFUSAL in run.stdout.splitlines()
        frozen, student, held, original = frozen_numbers(run)
        assert frozen == student == 0 and held["0"] == held["1"], run.describe()
        assert original < 1e-6, (name, original)
        assert "replicas differ" not in run.stderr


# ---- pair_draws.py and strided_split.py: the data set's draws and the sampler's stride --------


def test_draws_inside_a_data_set_are_shared_by_ranks_and_not_repeated_until_keyed(
    runs: dict[str, Run],
) -> None:
    for name, repeated, shared in (("pairs", False, 64), ("pairs_fix", True, 0)):
        run = runs[name]
        passed(run)
        lines = re.findall(
            r"^rank=(\d) pairs=64 repeated_after_reseed=(\d+)$", run.stdout, re.MULTILINE
        )
        assert sorted(rank for rank, _ in lines) == ["0", "1"], run.describe()
        for _, count in lines:
            # Python's random is not torch's: seeding torch again draws other pairs.
            assert (int(count) == 64) if repeated else (int(count) < 8), (name, lines)
        # Disjoint indices, and without --fix the same 64 pairs on both ranks.
        pattern = r"^indices_on_both_ranks=(\d+) pairs_on_both_ranks=(\d+) of 64$"
        indices, pairs = one_value(run, pattern)
        assert (int(indices), int(pairs)) == (0, shared), run.describe()


def test_loader_workers_seed_pythons_random_from_torchs_generator() -> None:
    """What the README says of --workers, in this process (loader workers forked, no gloo):
    each worker seeds Python's random from torch's generator, so two loaders after the same
    torch.manual_seed draw the same pairs; without workers they do not."""
    import torch
    from torch.utils.data import DataLoader

    draws = import_script(f"{YOUR_SCRIPT}/pair_draws.py")
    data = draws.Pairs(draws.make_images(0), fix=False, seed=0)

    def pairs(workers: int) -> list[list[int]]:
        torch.manual_seed(0)
        loader = DataLoader(data, batch_size=16, num_workers=workers)
        return [p.tolist() for *_, batch in loader for p in batch]

    assert pairs(1) == pairs(1), "workers: the same draws after the same torch seed"
    assert pairs(0) != pairs(0), "no workers: Python's random goes on"


def test_a_strided_split_that_lines_up_with_the_labels_costs_accuracy_through_batchnorm(
    runs: dict[str, Run],
) -> None:
    kinds, accuracy = {}, {}
    for name in ("strided", "strided_fix", "strided_no_bn"):
        run = runs[name]
        passed(run)
        found = re.findall(
            r"^rank=(\d) epoch=0 same_class_pairs=(\d+) other_class_pairs=(\d+)$",
            run.stdout,
            re.MULTILINE,
        )
        kinds[name] = {int(r): (int(a), int(b)) for r, a, b in found}
        batchnorm = "False" if name == "strided_no_bn" else "True"
        accuracy[name] = float(one_value(run, rf"^batchnorm={batchnorm} accuracy=(\S+)$"))
    # DistributedSampler(shuffle=False): rank 0 the even indices (pairs of one class), rank 1
    # the odd ones; shuffled, each rank both kinds.
    for name in ("strided", "strided_no_bn"):
        assert kinds[name] == {0: (128, 0), 1: (0, 128)}, kinds
    assert all(min(pair) > 0 for pair in kinds["strided_fix"].values()), kinds
    # With BatchNorm the split costs accuracy (0.625 against 0.812 here); without it the
    # averaged gradient is a mixed batch's and the split costs nothing (0.863).
    assert accuracy["strided"] + 0.1 < accuracy["strided_fix"], accuracy
    assert accuracy["strided"] + 0.1 < accuracy["strided_no_bn"], accuracy


# ---- equivalence.py: the controls for BatchNorm and an adaptive optimizer ----------------------


def test_batchnorm_differs_by_design_until_its_running_statistics_and_adam_is_rounding(
    runs: dict[str, Run],
) -> None:
    # A world of one: bit for bit, with BatchNorm and with Adam after InstanceNorm.
    assert set(diffs(runs["bn_one"], 1, " norm=batch").values()) == {0.0}
    one = diffs(runs["adam_one"], 1, " norm=instance optimizer=adam")
    assert set(one.values()) == {0.0}
    # BatchNorm on 2 ranks normalises over 16 rows, not 32: far from rounding after one step,
    # the same in float64 (a difference float64 does not shrink looks like a bug).
    bn = diffs(runs["bn"], 2, " norm=batch")
    assert bn["float32", 1] > 1e-4 and bn["float64", 1] > 1e-4, bn
    assert abs(bn["float32", 1] / bn["float64", 1] - 1) < 0.01, bn
    # The check-only switch: BatchNorm on its running statistics in both, then rounding.
    assert at_rounding_after_one_step(diffs(runs["bn_fix"], 2, " norm=batch_running"))
    # Adam and a bias before InstanceNorm: a float32 step far from rounding, which float64
    # shows to be rounding.
    adam = diffs(runs["adam"], 2, " norm=instance optimizer=adam")
    assert adam["float32", 1] > 1e-3 and adam["float64", 1] < 1e-14, adam


# ---- decisions.py: the drift step by step, its figure, and the signals torchrun hands on ------


def test_replicas_drift_from_the_step_the_ranks_decide_alone_and_the_figure_shows_it(
    runs: dict[str, Run], tmp_path: Path
) -> None:
    figure = import_script(f"{FIGURES}/draw_drift.py")
    alone, agreed = figure.parse(passed(runs["drift"])), figure.parse(passed(runs["drift_fix"]))
    for run in (alone, agreed):
        assert [step for step, _ in run["drift"]] == list(range(1, 193)), "every step"
    # Each rank lowers its learning rate after its own epoch: equal replicas until then, apart
    # from the first step after it, and the end's drift is the script's own last line.
    split = figure.first_split(alone["lr"])
    assert split is not None and 0 < split < 192, alone["lr"]
    drift = dict(alone["drift"])
    assert all(drift[step] == 0 for step in range(1, split + 1)), drift
    assert all(drift[step] > 0 for step in range(split + 1, 193)), drift
    last = float(one_value(runs["drift"], r"^replicas max_abs_diff=(\S+) steps=192$"))
    assert last == drift[192] > 1e-3, (last, drift[192])
    # --fix: one decision, from the all-reduced loss: the same learning rate, no drift.
    assert agreed["lr"][0] == agreed["lr"][1] and figure.first_split(agreed["lr"]) is None
    assert {diff for _, diff in agreed["drift"]} == {0.0}
    figure.draw({"alone": alone, "agreed": agreed}, tmp_path / "drift.png")
    assert_figure(tmp_path / "drift.png", f"{FIGURES}/drift.png")
    with pytest.raises(ValueError):
        figure.parse(runs["closure_fix"].stdout)


def test_torchrun_chooses_the_signals_its_workers_see_from_its_option_not_the_variable(
    runs: dict[str, Run],
) -> None:
    line = r"^rank 0 stops on SIGINT,SIGTERM; torchrun passes on (\S+)$"
    # TORCHELASTIC_SIGNALS_TO_HANDLE set before the launch: overwritten with the default.
    assert one_value(runs["drift_fix"], line) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    # PET_SIGNALS_TO_HANDLE (the variable of --signals-to-handle) chooses them.
    assert one_value(runs["signals"], line) == "SIGTERM,SIGUSR1"
    passed(runs["signals"])
