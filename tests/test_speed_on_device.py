"""Speed 4, the data on the device (part4_torchrun/speed/speed4_device_data.py): its augmentation
draws train.py's crops and flips, one per image, and normalises as train.py does; its batches are
each rank's shard, in the sampler's order, with their own labels; the CIFAR-10 branch takes the
data set's uint8 array; and a 2-rank torchrun run trains every image once from the device set,
not through the loader of PIL images. All but that run call the script's functions in this
process, on the CPU (the same tensor operations run on a GPU)."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TEST_SAMPLES, TINY_RUN, TORCHRUN, TRAIN_SAMPLES, Probe, launch
from course_steps import FAST4
from test_failures import import_script
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

LAUNCH_TIMEOUT = 240  # seconds; a hang detector: the run takes 10-20 s here
# Copies of one image in a batch: all 162 windows come up (about one chance in 350 million to
# miss one; the draws are seeded, so a run that passes always does)
COPIES = 4000
SPEED4 = import_script(FAST4)
MEAN = torch.tensor(SPEED4.CIFAR10_MEAN)[:, None, None]
STD = torch.tensor(SPEED4.CIFAR10_STD)[:, None, None]


def windows(image: torch.Tensor) -> dict[bytes, tuple[int, int, bool]]:
    """Every output train.py's RandomCrop(32, padding=4) and RandomHorizontalFlip can make of
    `image`: a 32x32 window of the zero-padded 40x40 image at (dy, dx), flipped or not."""
    padded = F.pad(image, (4, 4, 4, 4))
    where = [(dy, dx, flip) for dy in range(9) for dx in range(9) for flip in (False, True)]
    found = [padded[:, dy : dy + 32, dx : dx + 32] for dy, dx, _ in where]
    found = [w.flip(2) if flip else w for w, (*_, flip) in zip(found, where, strict=True)]
    return dict(zip(keys(torch.stack(found)), where, strict=True))


def keys(batch: torch.Tensor) -> list[bytes]:
    """Each image's integer pixel values, as bytes: a key that tells windows apart."""
    return [image.tobytes() for image in batch.round().to(torch.int32).numpy()]


def pixels(batch: torch.Tensor) -> torch.Tensor:
    """augment's output with its normalisation undone: the pixel values it cropped."""
    return (batch * STD + MEAN) * 255


def test_augment_draws_a_crop_and_a_flip_per_image() -> None:
    """A batch of copies of one image whose pixels all differ (and none is 0, the padding):
    each output is one window of the padded image, the 81 offsets and both flips all come up in
    one batch, about half flipped, and exactly the windows torchvision's transforms produce.
    The draws come from torch's generator: a seed repeats them, another changes them."""
    image = torch.arange(1, 3 * 32 * 32 + 1, dtype=torch.float32).view(3, 32, 32)
    reachable = windows(image)
    assert len(reachable) == 162
    batch = image.expand(COPIES, 3, 32, 32)
    torch.manual_seed(0)
    out = SPEED4.augment(batch)
    assert out.shape == batch.shape and out.dtype == torch.float32
    drawn = [reachable.get(k) for k in keys(pixels(out))]
    assert None not in drawn, "an output that is no window of the zero-padded image"
    assert {(dy, dx) for dy, dx, _ in drawn} == {(dy, dx) for dy in range(9) for dx in range(9)}
    flipped = sum(flip for _, _, flip in drawn) / COPIES
    assert 0.4 < flipped < 0.6, f"{flipped:.0%} flipped"
    assert len(set(drawn)) == 162, "one batch: every window, so one draw per image"
    torchvision = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    )
    theirs = set(keys(torch.stack([torchvision(image) for _ in range(COPIES)])))
    assert theirs == set(reachable) == set(keys(pixels(out)))
    torch.manual_seed(0)
    assert torch.equal(SPEED4.augment(batch), out), "the same seed, other draws"
    torch.manual_seed(1)
    assert not torch.equal(SPEED4.augment(batch), out), "another seed, the same draws"


def test_augment_normalises_as_train_py() -> None:
    """On uint8 pixels, as the device set holds them, each output equals, bit for bit, what
    train.py's PIL pipeline (crop, flip, ToTensor, Normalize) makes of one of the windows."""
    torch.manual_seed(0)
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    to_tensor = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(SPEED4.CIFAR10_MEAN, SPEED4.CIFAR10_STD)]
    )
    padded = transforms.functional.pad(transforms.ToPILImage()(image), 4)
    theirs = set()
    for dy in range(9):
        for dx in range(9):
            window = transforms.functional.crop(padded, dy, dx, 32, 32)
            for flipped in (window, transforms.functional.hflip(window)):
                theirs.add(to_tensor(flipped).numpy().tobytes())
    out = SPEED4.augment(image.expand(500, 3, 32, 32))
    assert {window.numpy().tobytes() for window in out} <= theirs


@pytest.mark.parametrize("world_size", [2, 3])
def test_device_batches_are_each_ranks_shard(world_size: int) -> None:
    """Each rank's batches hold the indices its DistributedSampler draws, in its order, with
    the labels of their own images; over the ranks every image comes once an epoch (and the
    few the sampler repeats to even out the shards once more), in another order each epoch;
    batches of batch_size, the last one possibly smaller."""
    n, batch_size = 100, 8
    # image k: every pixel k; label k
    images = torch.arange(n, dtype=torch.uint8)[:, None, None, None].expand(n, 3, 32, 32)
    labels = torch.arange(n)
    orders = []
    for epoch in (0, 1):
        drawn = []
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), world_size, rank, seed=0)
            sampler.set_epoch(epoch)
            batches = list(SPEED4.device_batches(images, labels, sampler, batch_size))
            sizes = [len(y) for _, y in batches]
            assert set(sizes[:-1]) == {batch_size} and 0 < sizes[-1] <= batch_size, sizes
            for x, y in batches:
                assert x.dtype == torch.uint8 and x.shape == (len(y), 3, 32, 32)
                assert torch.equal(x, y[:, None, None, None].to(torch.uint8).expand_as(x))
            order = [int(i) for _, y in batches for i in y]
            assert order == list(sampler), f"rank {rank}: not its sampler's indices"
            drawn += order
        total = math.ceil(n / world_size) * world_size
        counts = Counter(drawn)
        assert len(drawn) == total and set(counts) == set(range(n)), "not every image"
        assert sum(counts.values()) - len(counts) == total - n, "an image more than padded"
        orders.append(drawn)
    assert orders[0] != orders[1], "the same order in both epochs"


def test_cifar10_comes_as_its_uint8_array(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --dataset cifar10, the images device_batches gets are CIFAR10's .data, (N, 32, 32,
    3) uint8, as (N, 3, 32, 32), and its labels .targets. A stand-in data set serves (no
    download here); main stops at device_batches."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
    targets = [int(t) for t in rng.integers(0, 10, 20)]

    class Cifar10:
        """What the script reads of torchvision's CIFAR10."""

        def __init__(self, root, train, transform, download=False):
            self.data, self.targets = (data, targets) if train else (data[:5], targets[:5])

        def __len__(self) -> int:
            return len(self.data)

    class Reached(Exception):
        pass

    got = {}

    def device_batches(images, labels, sampler, batch_size):
        got.update(images=images, labels=labels)
        raise Reached

    monkeypatch.setattr(SPEED4.torchvision.datasets, "CIFAR10", Cifar10)
    monkeypatch.setattr(SPEED4, "device_batches", device_batches)
    monkeypatch.setattr(sys, "argv", ["speed4", "--device-data", "--checkpoint", ""])
    for name in ("RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}.items():
        monkeypatch.setenv(name, value)  # main sets them: restored after the test
    args = SPEED4.parse_args()
    try:
        with pytest.raises(Reached):
            SPEED4.main(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert got["images"].dtype == torch.uint8
    assert torch.equal(got["images"], torch.from_numpy(data).permute(0, 3, 1, 2))
    assert torch.equal(got["labels"], torch.tensor(targets))


def test_two_ranks_train_each_image_once_from_the_device_set(
    tmp_path: Path, probe_dir: Path
) -> None:
    """torchrun, 2 ranks, --device-data: one epoch line that counts every training image once
    and every test image once. The probe shows where the batches came from: device_batches'
    loader (the third the script builds) gave the ranks disjoint shards of the whole set, and
    the loader of PIL images (the first) gave none. Each rank prints the line of each speed
    step: its precision, its layout and compile, its loader's workers and pinning."""
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", FAST4, *TINY_RUN]
    command += ["--device-data", "--epochs", "1", "--checkpoint", str(tmp_path / "model.pt")]
    run = launch(command, timeout=LAUNCH_TIMEOUT, probe_dir=probe_dir)
    (epoch,) = run.epochs()
    assert epoch["train_samples"] == TRAIN_SAMPLES, run.describe()
    assert epoch["test_samples"] == TEST_SAMPLES, run.describe()
    probe = Probe.read(probe_dir)
    assert [probe.indices(rank, loader=0) for rank in (0, 1)] == [[], []], "PIL batches"
    shards = [probe.indices(rank, loader=2) for rank in (0, 1)]
    assert sorted(shards[0] + shards[1]) == list(range(TRAIN_SAMPLES)), shards
    # Each rank says what it trains with, one line per speed step (CPU defaults): the workers
    # those of the loader that gave its batches, as the probe saw them.
    (workers,) = {r["workers"] for r in probe.events("batch") if r["loader"] == 2}
    lines = run.stdout.splitlines()
    for said in (
        "autocast=off GradScaler=False",
        "channels_last=False compile=False",
        f"workers={workers} pinned=False",
    ):
        assert lines.count(said) == 2, f"{said!r} once per rank\n{run.describe()}"
