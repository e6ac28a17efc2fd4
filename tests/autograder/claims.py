"""The claims, in step order (the one list the grader, its report and its tests read), and
grading: every claim's verdict on one training run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .causes import exceptions
from .checks import (
    MIN_TEST_ACC,
    NotChecked,
    Verdict,
    check_accuracy,
    check_batches,
    check_checkpoint,
    check_counts,
    check_evaluation,
    check_figures,
    check_gpu,
    check_gradient,
    check_group,
    check_in_sync,
    check_loss,
    check_lr,
    check_optimizer,
    check_order,
    check_printing,
    check_read_after_write,
    check_run,
    check_shards,
    check_steps,
    check_test_shares,
    check_threads,
    check_wrap,
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
    Claim("wrap", "step 2", "each rank wraps its model in DDP once", check_wrap),
    Claim(
        "optimizer",
        "step 2",
        "the optimizer steps the parameters of the model that computes the loss, and they change",
        check_optimizer,
    ),
    Claim(
        "steps",
        "step 2",
        "every optimizer step, in every epoch, follows one forward and backward() of one batch,"
        " in train mode, and as many steps on every rank",
        check_steps,
    ),
    Claim(
        "lr",
        "step 2",
        "every rank steps with the same learning rate at every step",
        check_lr,
    ),
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
    Claim(
        "batches",
        "step 3",
        "each rank's training batches hold --batch-size samples: it is per process",
        check_batches,
    ),
    Claim("order", "step 3", "the order is shuffled, and new each epoch", check_order),
    Claim(
        "test_shares",
        "step 3",
        "each rank evaluates its own share of the test set, without padding",
        check_test_shares,
    ),
    Claim(
        "figures",
        "step 3",
        "every figure of the epoch lines is possible: losses >= 0, accuracies within 0-100%,"
        " counts within the data sets",
        check_figures,
    ),
    Claim(
        "counts",
        "step 3",
        "the epoch lines' counts are sums over the ranks",
        check_counts,
    ),
    Claim(
        "loss",
        "step 3",
        "the epoch lines' train_loss is the mean of the losses the ranks computed",
        check_loss,
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
    Claim(
        "evaluation",
        "result",
        "every rank evaluates in eval mode (model.eval(): no dropout)",
        check_evaluation,
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
    # a failure that accounts for the job's crash (Verdict.explains): it opens the report
    explains_crash: bool = False

    @property
    def headline(self) -> str:
        return f"{self.blame or self.claim.step}: {self.text}"


def grade(t: Training) -> list[Finding]:
    """Every claim, in step order: holds, fails, or not checked. A failure that accounts for
    the job's crash (a missing DDP wrap for an AttributeError on `model.module`) says so."""
    findings, explaining = [], {}
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
            explaining[claim.key] = verdict.explains
        else:
            findings.append(Finding(claim, "ok", verdict.evidence))
    crash = crashed(t) if findings[0].status == "FAIL" else None
    for f in findings[1:]:
        explains = explaining.get(f.claim.key)
        if crash and explains and explains(crash):
            f.text = f"{f.text}. That is why {findings[0].text}"
            f.explains_crash = True
            break
    return findings


def crashed(t: Training) -> str | None:
    """The `Type: message` of the first rank that raised on its own, when the job failed."""
    own = [c for c in exceptions(t) if not c["in_communication"]] if t.failed else []
    return own[0]["what"] if own else None


def failing(findings: list[Finding]) -> dict[str, Finding]:
    """claim key -> finding, for the claims that fail, the one that opens the report first."""
    failed = [f for f in findings if f.status == "FAIL"]
    failed.sort(key=lambda f: not f.explains_crash)
    return {f.claim.key: f for f in failed}


def first_failure(findings: list[Finding]) -> Finding | None:
    """The failure that opens the report: the first in step order, unless a later one accounts
    for the job's crash (the crash's own line is then a consequence)."""
    return next(iter(failing(findings).values()), None)
