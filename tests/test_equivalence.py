"""The equivalence recipe (part4_torchrun/your_script/equivalence.py): a world of one matches the
original bit for bit, N ranks match it to rounding after one step; with randomness once the
original takes the samplers' rows and the noise is drawn per sample; and the float64 run tells a
chaotic training from a bug. A world of one runs under plain python (no torchrun: cheaper); the
launches of a test run two at a time."""

from __future__ import annotations

import math
import re

from conftest import PYTHON, TORCHRUN_2, YOUR_SCRIPT, Run, launch_at_once

SCRIPT = f"{YOUR_SCRIPT}/equivalence.py"
# Seconds per launch; healthy ones take 4-13 s here, more on a loaded 2-core machine.
TIMEOUT = 180
LINE = re.compile(
    r"^equivalence ranks=(\d) batch=32 per_rank=(\d+)(.*) dtype=(\w+) step=(\d+)"
    r" max_abs_diff=(\S+)$",
    re.MULTILINE,
)
CHAOS = ["--lr", "1", "--steps", "40"]
BUG = [*CHAOS, "--bug", "batch-per-rank"]


def runs(*commands: tuple[int, list[str]]) -> list[Run]:
    """(ranks, options) -> the run of equivalence.py: 1 rank under python, 2 under torchrun;
    two launches at a time."""
    launches = [
        [*([PYTHON] if ranks == 1 else TORCHRUN_2), SCRIPT, *options] for ranks, options in commands
    ]
    return launch_at_once(launches, timeout=TIMEOUT, at_once=2)


def diffs(run: Run, ranks: int, options: str = "") -> dict[tuple[str, int], float]:
    """(dtype, step) -> max |w_ddp - w_original| from the script's lines, which must all say
    `ranks` ranks and the options `options` (as the lines spell them)."""
    rows = LINE.findall(run.stdout)
    assert rows, f"no equivalence line\n{run.describe()}"
    found = {}
    for got_ranks, per_rank, got_options, dtype, step, diff in rows:
        assert (int(got_ranks), got_options) == (ranks, options), run.describe()
        per = 32 if "bug=batch-per-rank" in options else 32 // ranks
        assert int(per_rank) == per, run.describe()
        found[dtype, int(step)] = float(diff)
    assert sorted({dtype for dtype, _ in found}) == ["float32", "float64"], run.describe()
    return found


def at_rounding_after_one_step(two: dict[tuple[str, int], float]) -> bool:
    """float32 ~1e-8 and float64 ~1e-17 for weights of order 1: a rounding error."""
    return two["float32", 1] < 1e-6 and two["float64", 1] < 1e-14


def test_one_process_reproduces_the_original_and_two_ranks_match_it_then_drift_slowly() -> None:
    one, two = runs((1, []), (2, []))
    one, two = diffs(one, 1), diffs(two, 2)
    assert len(one) == 6 and set(one.values()) == {0.0}, "bit for bit, at every checkpoint"
    assert sorted(two) == sorted(one)
    assert at_rounding_after_one_step(two), two
    # After that the difference grows, slowly, and float64 stays far below float32.
    for dtype in ("float32", "float64"):
        assert two[dtype, 1] <= two[dtype, 10] <= two[dtype, 100], two
    assert two["float32", 100] < 1e-4 and two["float64", 100] < 1e-12, two
    assert two["float64", 100] < two["float32", 1], two


def test_samplers_rows_and_noise_per_sample_restore_the_match() -> None:
    shuffled, noise_two, noise_one, fixed_two, fixed_one = runs(
        (1, ["--shuffle"]),
        (2, ["--noise"]),
        (1, ["--noise"]),
        (2, ["--shuffle", "--noise", "--fix"]),
        (1, ["--shuffle", "--noise", "--fix"]),
    )
    # The original's shuffle=True is another order than the DistributedSampler's: even a world
    # of one differs, by far more than rounding, after one step.
    shuffled = diffs(shuffled, 1, " original_order=shuffle")
    assert min(shuffled["float32", 1], shuffled["float64", 1]) > 1e-3, shuffled
    # Noise from torch's generator: a world of one draws the original's noise (the same seed,
    # the same draws in the same order), two ranks draw the same noise for different rows.
    assert set(diffs(noise_one, 1, " noise=global").values()) == {0.0}
    noise_two = diffs(noise_two, 2, " noise=global")
    assert min(noise_two["float32", 1], noise_two["float64", 1]) > 1e-3, noise_two
    # With --fix: the samplers' rows for the original, the noise drawn per sample.
    options = " original_order=samplers noise=per_sample"
    fixed_one, fixed_two = diffs(fixed_one, 1, options), diffs(fixed_two, 2, options)
    assert len(fixed_one) == 6 and set(fixed_one.values()) == {0.0}, fixed_one
    assert sorted(fixed_two) == sorted(fixed_one)
    assert at_rounding_after_one_step(fixed_two), fixed_two
    assert fixed_two["float32", 100] < 1e-4 and fixed_two["float64", 100] < 1e-12, fixed_two
    # The cause of the first run: one replica of a DistributedSampler does not draw the order
    # of shuffle=True from the same seed.
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(32))
    torch.manual_seed(0)
    in_order = [int(i) for i in DataLoader(data, batch_size=None, shuffle=True)]
    sampled = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    assert sorted(in_order) == sorted(sampled) == data and in_order != sampled


def test_float64_tells_a_chaotic_training_from_a_bug() -> None:
    chaos, bug, bug_alone = runs((2, CHAOS), (2, BUG), (1, BUG))
    chaos = diffs(chaos, 2, " lr=1")
    assert sorted(step for dtype, step in chaos if dtype == "float64") == [1, 10, 40]
    # A correct port: rounding after one step in both dtypes, then a drift to the size of the
    # weights in float32 (2.41 here) that alone looks like a bug.
    assert at_rounding_after_one_step(chaos), chaos
    assert chaos["float32", 40] > 0.1, chaos
    # Both grow by the same kind of factor (1.6e8 and 1.5e9 here, over 39 steps) ...
    growth = {dtype: chaos[dtype, 40] / chaos[dtype, 1] for dtype in ("float32", "float64")}
    assert min(growth.values()) > 1e5, growth
    assert abs(math.log10(growth["float32"] / growth["float64"])) < 2, growth
    # ... so float64 stays 1e-9 to 1e-7 times float32 (3.7e-9, 1.6e-9, 3.6e-8 here; 2^-29 =
    # 1.9e-9 is the ratio of their rounding units).
    for step in (1, 10, 40):
        assert chaos["float64", step] < 1e-6 * chaos["float32", step], chaos
    # The planted bug: far above rounding after one step, in float64 as in float32 ...
    bug = diffs(bug, 2, " lr=1 bug=batch-per-rank")
    assert bug["float64", 1] > 1e-3 and bug["float64", 1] > 0.1 * bug["float32", 1], bug
    # ... and invisible to a world of one, where B rows per rank is the original's batch.
    bug_alone = diffs(bug_alone, 1, " lr=1 bug=batch-per-rank")
    assert set(bug_alone.values()) == {0.0}, bug_alone
