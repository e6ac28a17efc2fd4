"""Two mistakes of a ported script that print nothing (part4_torchrun/your_script/): a seed drawn
at random in each process (random_seed.py) and a loss summed over the batch (summed_loss.py).
Each script runs twice under torchrun, without --fix and with it, the two launches at once; the
tests assert the numbers the scripts measure (random_seed.py under the chapter's checker, which
must name the samplers' seeds), and the shards' figure is drawn from random_seed.py's runs."""

from __future__ import annotations

import math
import re
from pathlib import Path

from conftest import (
    CHECKER_COMMAND,
    TORCHRUN_2,
    YOUR_SCRIPT,
    Run,
    assert_figure,
    import_script,
    launch,
    launch_at_once,
)

# Seconds per launch; healthy ones take 10-20 s on a loaded 2-core machine.
TIMEOUT = 180


def without_and_with_fix(script: str, *args: str, checked: bool = False) -> dict[bool, Run]:
    """fix -> the run of `script ARGS` on 2 gloo ranks, the two launched at once; checked: under
    the chapter's checker (its exit status is 1 when a check fails)."""
    commands = [
        [*(CHECKER_COMMAND if checked else []), *TORCHRUN_2, f"{YOUR_SCRIPT}/{script}", *args, *fix]
        for fix in ([], ["--fix"])
    ]
    unfixed, fixed = launch_at_once(commands, timeout=TIMEOUT, check=not checked)
    return {False: unfixed, True: fixed}


def number(run: Run, pattern: str) -> float:
    """The one number `pattern` (a regular expression with one group) finds in the output."""
    found = re.findall(pattern, run.stdout, re.MULTILINE)
    assert len(found) == 1, f"{pattern!r}: {found}\n{run.describe()}"
    return float(found[0])


def overlap(seeds: dict[int, int], samples: int) -> int:
    """Samples that the DistributedSamplers of 2 ranks, seeded with `seeds`, both draw."""
    from torch.utils.data import DistributedSampler

    shards = [
        set(DistributedSampler(range(samples), num_replicas=2, rank=rank, seed=seed))
        for rank, seed in seeds.items()
    ]
    return len(shards[0] & shards[1])


def seeds_of(run: Run) -> dict[int, int]:
    """rank -> the seed it printed."""
    found = re.findall(r"^rank=(\d) seed=(\d+)$", run.stdout, re.MULTILINE)
    seeds = {int(rank): int(seed) for rank, seed in found}
    assert sorted(seeds) == [0, 1] and len(found) == 2, run.describe()
    assert all(1 <= seed <= 10000 for seed in seeds.values()), seeds
    assert number(run, r"^samples=(\d+) on_both") == 128
    return seeds


def test_a_seed_drawn_in_each_process_overlaps_the_shards_and_rank_0s_seed_does_not(
    tmp_path: Path,
) -> None:
    runs = without_and_with_fix("random_seed.py", "--show-shards", checked=True)
    # With --fix: rank 0's seed on both ranks, disjoint shards that cover the data set.
    fixed = runs[True]
    assert fixed.returncode == 0, fixed.describe()
    assert "ddp_check: ok    loader samples disjoint (loader 0" in fixed.stdout, fixed.describe()
    seeds = seeds_of(fixed)
    assert seeds[0] == seeds[1], fixed.describe()
    assert number(fixed, r"\bon_both_ranks=(\d+)") == 0, fixed.describe()
    assert number(fixed, r"\bon_no_rank=(\d+)") == 0
    # Without: a seed of its own on each rank. Two draws from 1..10000 agree in 1 run of
    # 10,000: then once more (a script that always agrees the seed fails here).
    unfixed = runs[False]
    seeds = seeds_of(unfixed)
    if seeds[0] == seeds[1]:
        command = [*CHECKER_COMMAND, *TORCHRUN_2, f"{YOUR_SCRIPT}/random_seed.py", "--show-shards"]
        unfixed = launch(command, timeout=TIMEOUT, check=False)
        seeds = seeds_of(unfixed)
    assert seeds[0] != seeds[1], unfixed.describe()
    # The checker fails the loader and names the cause: the samplers' seeds, as printed.
    assert unfixed.returncode == 1, unfixed.describe()
    hint = (
        "the DistributedSampler's seed differs between ranks"
        f" (rank 0: {seeds[0]}, rank 1: {seeds[1]}): agree the seed (broadcast rank 0's)"
    )
    assert "ddp_check: FAIL  loader samples disjoint (loader 0" in unfixed.stdout
    assert hint in unfixed.stdout, unfixed.describe()
    both = number(unfixed, r"\bon_both_ranks=(\d+)")
    assert both > 0, unfixed.describe()
    # 64 samples a rank: each sample on both ranks leaves one on none.
    assert both == number(unfixed, r"\bon_no_rank=(\d+)"), unfixed.describe()
    # The count is the real overlap of the two samplers with the seeds the ranks printed.
    assert both == overlap(seeds, 128), (seeds, unfixed.describe())

    # The figure: each rank's shard as printed, the overlap counted above, none with --fix.
    figure = import_script(f"{YOUR_SCRIPT}/figures/draw_shards.py")
    plotted = {"own": figure.parse(unfixed.stdout), "agreed": figure.parse(fixed.stdout)}
    from torch.utils.data import DistributedSampler

    for key, run in (("own", unfixed), ("agreed", fixed)):
        data = plotted[key]
        assert data["seeds"] == seeds_of(run) and data["samples"] == 128
        for rank, shard in data["shards"].items():
            drawn = DistributedSampler(range(128), 2, rank, seed=data["seeds"][rank])
            assert shard == list(drawn), "the shard as the rank's sampler draws it"
        rows = {label.split(":")[0]: samples for label, _, samples in figure.strips(data)}
        assert len(rows["on both"]) == len(rows["on none"]) == (both if key == "own" else 0)
    figure.draw(plotted, tmp_path / "shards.png")
    assert_figure(tmp_path / "shards.png", f"{YOUR_SCRIPT}/figures/shards.png")


def test_a_summed_loss_halves_the_gradient_on_two_ranks_and_the_world_size_restores_it() -> None:
    runs = without_and_with_fix("summed_loss.py")
    for fix, run in runs.items():
        ddp = number(run, r"\bgrad_norm_ddp=(\S+)")
        one = number(run, r"\bgrad_norm_one_process=(\S+)")
        weights = number(run, r"^max_abs_weight_diff=(\S+)$")
        if fix:
            assert math.isclose(ddp, one, rel_tol=1e-5), run.describe()
            assert weights < 1e-6, "rounding, in float32"
        else:
            # DDP divides the sum of the 2 ranks' gradients by 2: half the original's.
            assert math.isclose(ddp / one, 0.5, rel_tol=1e-5), run.describe()
            assert weights > 1e-3, "far above rounding"
        # Clipping: the norm of the averaged gradient, the same on every rank, and the same
        # fraction of the original's as above; clipped to 1.0 it is the original's clipped.
        clip = re.findall(r"^clip_norm rank=(\d) norm=(\S+)$", run.stdout, re.MULTILINE)
        assert sorted(rank for rank, _ in clip) == ["0", "1"], run.describe()
        assert clip[0][1] == clip[1][1], clip
        clip_one = number(run, r"^clip_norm one_process norm=(\S+) ")
        ratio = float(clip[0][1]) / clip_one
        assert math.isclose(ratio, 1.0 if fix else 0.5, rel_tol=1e-5), (ratio, run.describe())
        assert number(run, r"\bclipped_vs_one_process=(\S+)$") < 1e-6
        # Two losses, then one step. Each backward after its own forward, or one backward of
        # the sum: the average over the ranks, equal on every rank and to the original's. Both
        # forwards, then two backward passes: the second is left out of the all-reduce, and each
        # rank keeps a gradient of its own.
        lines = re.findall(
            r"^two_backward_vs_one_process=(\S+) order=(\S+) between_ranks=(\S+)$",
            run.stdout,
            re.MULTILINE,
        )
        found = {order: (float(diff), float(ranks)) for diff, order, ranks in lines}
        orders = ["fwd,bwd,fwd,bwd", "fwd,fwd,bwd,bwd", "fwd,fwd,bwd_of_sum"]
        assert sorted(found) == orders and len(lines) == 3, run.describe()
        for order in ("fwd,bwd,fwd,bwd", "fwd,fwd,bwd_of_sum"):
            diff, ranks = found[order]
            assert diff < 1e-6 and ranks == 0, found
        diff, ranks = found["fwd,fwd,bwd,bwd"]
        assert diff > 1e-3 and ranks > 1e-3, found
