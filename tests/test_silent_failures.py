"""A forward outside the training step and buffers that differ between ranks
(part4_torchrun/your_script/): outside_step.py and buffers_agree.py run under torchrun without
--fix (a hang ended by the gloo timeout; running statistics that differ, so losses that differ)
and with it (replicas equal; buffers and losses equal), the launches of a script at once; the
tests assert the numbers and the messages the scripts print. wrapper.py's full_batch effect runs
in the test process, for each rank of 2 and for a world of one, and so does its forward_device
effect."""

from __future__ import annotations

import re

from conftest import TORCHRUN_2, YOUR_SCRIPT, Run, import_script, launch_at_once

# Seconds per launch; healthy ones take 10-20 s on a loaded 2-core machine.
TIMEOUT = 180
ERROR_LINE = re.compile(r"^\[rank(\d)\]: RuntimeError: (.*)$", re.MULTILINE)


def launches(script: str, *variants: tuple[str, ...]) -> list[Run]:
    """The script on 2 gloo ranks once per variant (its arguments), all launched at once."""
    commands = [[*TORCHRUN_2, f"{YOUR_SCRIPT}/{script}", *args] for args in variants]
    return launch_at_once(commands, timeout=TIMEOUT, check=False)


# ---- outside_step.py: a forward through the wrapper on rank 0 alone ----------------------------


def samples(run: Run) -> list[tuple[int, str, int]]:
    """Rank 0's sample lines: (step, through, buffer broadcasts so far)."""
    found = re.findall(
        r"^rank=0 sample step=(\d+) through=(\w+) buffer_broadcasts=(\d+)$", run.stdout, re.M
    )
    return [(int(step), through, int(count)) for step, through, count in found]


def ends(run: Run) -> dict[int, tuple[int, int, int]]:
    """rank -> (steps, samples, buffer broadcasts) from each rank's last line."""
    found = re.findall(
        r"^rank=(\d) steps=(\d+) samples=(\d+) buffer_broadcasts=(\d+)$", run.stdout, re.M
    )
    return {int(rank): tuple(map(int, rest)) for rank, *rest in found}


def test_a_sample_through_the_wrapper_on_rank_0_hangs_and_through_module_it_does_not() -> None:
    unfixed, fixed = launches("outside_step.py", ("--timeout", "3"), ("--fix",))

    # Without --fix: each sample forward broadcasts rank 0's buffers. In mid-run rank 1's next
    # training forward answers it (rank 0's next forward skips its own: one more each time,
    # then level); the sample after the last step has no partner: 41 broadcasts against 40.
    assert unfixed.returncode != 0, unfixed.describe()
    assert samples(unfixed) == [
        (10, "wrapper", 11),
        (20, "wrapper", 21),
        (30, "wrapper", 31),
        (40, "wrapper", 41),
    ], unfixed.describe()
    assert ends(unfixed) == {1: (40, 0, 40)}, "rank 0 never left its last sample"
    assert "replicas max_abs_diff" not in unfixed.stdout
    # Rank 0 waits in the sample's buffer broadcast, rank 1 in the all_gather after training,
    # until one times out; the other times out too, or finds its peer gone.
    # gloo words its timeout two ways, depending on where the wait was when it ran out.
    errors = ERROR_LINE.findall(unfixed.stderr)
    assert sorted(rank for rank, _ in errors) == ["0", "1"], unfixed.describe()
    timeouts = ("Timed out waiting 3000ms for", "Application timeout caused pair closure")
    assert any(any(t in error for t in timeouts) for _, error in errors), errors
    ends_of_a_hang = (*timeouts, "Connection closed by peer")
    assert all(any(end in error for end in ends_of_a_hang) for _, error in errors), errors
    for rank, where in (("0", "_sync_buffers"), ("1", "all_gather")):
        assert re.search(rf"^\[rank{rank}\]: .* in {where}$", unfixed.stderr, re.M), where

    # With --fix: the samples go to model.module, no collective; the same broadcasts on every
    # rank, one per training forward, and the replicas equal.
    assert fixed.returncode == 0, fixed.describe()
    assert samples(fixed) == [(step, "module", step) for step in (10, 20, 30, 40)]
    assert ends(fixed) == {0: (40, 4, 40), 1: (40, 0, 40)}, fixed.describe()
    assert re.findall(r"^replicas max_abs_diff=(\S+)$", fixed.stdout, re.M) == ["0"]


# ---- buffers_agree.py: running statistics that differ between ranks ----------------------------


def buffer_lines(run: Run) -> dict[str, tuple[int, int, float]]:
    """after -> (buffers that differ, buffers, largest difference)."""
    found = re.findall(
        r"^after=(\w+) buffers_differ=(\d+) of (\d+) max_abs_diff=(\S+)$", run.stdout, re.M
    )
    return {after: (int(k), int(n), float(diff)) for after, k, n, diff in found}


def losses(run: Run) -> dict[str, str]:
    """'module 0', 'wrapper 1', 'checkpoint' -> the loss printed (compared as printed)."""
    found = {
        f"{how} {rank}": loss
        for rank, how, loss in re.findall(
            r"^rank=(\d) eval=(module|wrapper) loss=([\d.]+)$", run.stdout, re.M
        )
    }
    (found["checkpoint"],) = re.findall(r"^checkpoint loss=([\d.]+)$", run.stdout, re.M)
    assert len(found) == 5, run.describe()
    return found


def test_running_statistics_differ_after_training_and_agree_once_averaged_or_broadcast() -> None:
    unfixed, average, broadcast = launches(
        "buffers_agree.py", (), ("--fix",), ("--fix", "broadcast")
    )
    for run in (unfixed, average, broadcast):
        assert run.returncode == 0, run.describe()

    # Without --fix: each rank's last forward updated its own running means and variances
    # (4 of the 6 buffers; the 2 num_batches_tracked counters agree), so each rank's bare model
    # scores another loss, and the checkpoint holds rank 0's.
    found, own = buffer_lines(unfixed), losses(unfixed)
    differ, total, largest = found["training"]
    assert (differ, total) == (4, 6) and 0 < largest < 1, found
    assert own["module 0"] != own["module 1"], own
    assert own["checkpoint"] == own["module 0"], "rank 0 saved its own statistics"
    # Through the wrapper every rank scores rank 0's model: that forward copies rank 0's
    # buffers to every rank first, and then they agree.
    assert own["wrapper 0"] == own["wrapper 1"] == own["module 0"], own
    assert found["wrapper_eval"] == (0, 6, 0.0), found

    # With --fix (the mean) and --fix broadcast (rank 0's): the buffers agree before anything
    # is scored or saved, and every evaluation, the checkpoint's too, gives one loss.
    agreed = {}
    for run, how in ((average, "average"), (broadcast, "broadcast")):
        found, loss = buffer_lines(run), losses(run)
        assert found == {how: (0, 6, 0.0), "wrapper_eval": (0, 6, 0.0)}, found
        assert len(set(loss.values())) == 1, (how, loss)
        agreed[how] = loss["module 0"]
    # Rank 0's statistics give the unfixed rank 0's loss; the mean gives neither rank's.
    assert agreed["broadcast"] == own["module 0"], (agreed, own)
    assert agreed["average"] not in (own["module 0"], own["module 1"]), (agreed, own)


# ---- wrapper.py: a batch assumed full -----------------------------------------------------------


def test_a_view_with_the_configured_batch_size_fails_on_a_shards_shorter_last_batch() -> None:
    wrapper = import_script(f"{YOUR_SCRIPT}/wrapper.py")
    # One device: 12 samples make three full batches of 4, so the habit works.
    for fix in (False, True):
        assert wrapper.full_batch(fix, rank=0, world_size=1) == "ok rows=[4, 4, 4]"
    # 2 ranks: 6 samples a shard, a batch of 4 and one of 2 (2 samples of 3 x 3: 18 values).
    for rank in (0, 1):
        assert wrapper.full_batch(False, rank=rank, world_size=2) == (
            "error=RuntimeError: shape '[4, -1]' is invalid for input of size 18"
        )
        assert wrapper.full_batch(True, rank=rank, world_size=2) == "ok rows=[4, 2]"


# ---- wrapper.py: a tensor made inside forward without a device ---------------------------------


def test_a_tensor_made_in_forward_without_a_device_lands_on_the_cpu() -> None:
    wrapper = import_script(f"{YOUR_SCRIPT}/wrapper.py")
    # The meta device stands in for a GPU: the mask made without a device is a CPU tensor.
    assert wrapper.forward_device(False) == (
        "made_on=cpu error=RuntimeError: Tensor on device cpu is not on the expected device meta!"
    )
    assert wrapper.forward_device(True) == "ok made_on=meta"
