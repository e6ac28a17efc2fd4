"""The claims, in step order (the one list the grader, its report and its tests read), and
grading: every claim's verdict on one training run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .checks import (
    MIN_TEST_ACC,
    NotChecked,
    Verdict,
    check_accuracy,
    check_checkpoint,
    check_counts,
    check_gpu,
    check_gradient,
    check_group,
    check_in_sync,
    check_order,
    check_printing,
    check_read_after_write,
    check_run,
    check_shards,
    check_test_shares,
    check_threads,
    fails,
)
from .run import Training


@dataclass(frozen=True)
class Claim:
    key: str
    step: str
    text: str
    check: Callable[[Training], Verdict]


# Every claim, in step order: the one list the grader, its report and its tests read.
CLAIMS = [
    Claim("run", "run", "the job runs to the end on every rank", check_run),
    Claim(
        "group",
        "step 1",
        "every rank joins one gloo process group, with its launcher's rank, and leaves it",
        check_group,
    ),
    Claim(
        "threads",
        "step 1",
        "each rank uses the threads its launch gave it (OMP_NUM_THREADS)",
        check_threads,
    ),
    Claim("printing", "step 1", "only rank 0 prints the epoch lines", check_printing),
    Claim(
        "gradient",
        "step 2",
        "a step applies, on every rank, one process's gradient on all ranks' batches together",
        check_gradient,
    ),
    Claim("in_sync", "step 2", "the ranks' parameters are equal after training", check_in_sync),
    Claim(
        "shards",
        "step 3",
        "each epoch the ranks split one permutation of the training set",
        check_shards,
    ),
    Claim("order", "step 3", "the order is shuffled, and new each epoch", check_order),
    Claim(
        "test_shares",
        "step 3",
        "each rank evaluates its own share of the test set, without padding",
        check_test_shares,
    ),
    Claim(
        "counts",
        "step 3",
        "the epoch lines' counts are sums over the ranks",
        check_counts,
    ),
    Claim("gpu", "step 4", "each rank computes on its own GPU, cuda:LOCAL_RANK", check_gpu),
    Claim(
        "checkpoint",
        "step 5",
        "rank 0 alone writes the checkpoint: the trained weights, keys without 'module.'",
        check_checkpoint,
    ),
    Claim(
        "read_after_write",
        "step 5",
        "no rank reads the checkpoint before rank 0 has written it (a barrier between)",
        check_read_after_write,
    ),
    Claim("accuracy", "result", f"test accuracy >= {MIN_TEST_ACC}%", check_accuracy),
]


@dataclass
class Finding:
    claim: Claim
    # "ok", "FAIL", or "--" (not checked)
    status: str
    # ok: the evidence; FAIL: the cause and what to do; --: why it was not checked
    text: str
    blame: str | None = None

    @property
    def headline(self) -> str:
        return f"{self.blame or self.claim.step}: {self.text}"


def grade(t: Training) -> list[Finding]:
    """Every claim, in step order: holds, fails, or not checked."""
    findings = []
    for claim in CLAIMS:
        try:
            verdict = claim.check(t)
        except NotChecked as missing:
            findings.append(Finding(claim, "--", str(missing)))
            continue
        # A damaged file, wrong keys, a crashed import: a finding, not an error of the grader.
        except Exception as error:
            verdict = fails(f"{type(error).__name__}: {error}")
        if verdict.problem:
            findings.append(Finding(claim, "FAIL", verdict.problem, verdict.blame))
        else:
            findings.append(Finding(claim, "ok", verdict.evidence))
    return findings


def failing(findings: list[Finding]) -> dict[str, Finding]:
    """claim key -> finding, for the claims that fail."""
    return {f.claim.key: f for f in findings if f.status == "FAIL"}
