"""Mutant gallery (a tool, not a test): one-mistake versions of a model solution, each graded
by the exercise autograder through the path a learner's script takes, with a table of what
the grader said: mutant, world size, verdict (the step its report names first, or "pass"),
whether that is the step and cause the mistake should get, and the report's first line.

    python tests/grade_mutants.py                       # all, as a learner's script is graded
    python tests/grade_mutants.py --quick               # 400 digits, 2 epochs: ~3x faster
    python tests/grade_mutants.py --only "shuffle=False" --base srun

MUTANTS is also where test_exercises.py takes the mistakes it plants.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autograder.claims import CLAIMS, failing, grade
from autograder.report import write_log
from autograder.run import GRADE_EPOCHS, SOLUTIONS, Target, train
from conftest import REPO
from mnist_data import (
    GRADED_TEST,
    SMALL_TEST,
    SMALL_TRAIN,
    TRAIN_DIGITS,
    first_digits,
    get_mnist_subset,
)
from tqdm import tqdm

# An edit: every line of the solution equal to (else starting with) the text, replaced
# (None: removed). Each text must pick exactly one line.
Edit = tuple[str, "str | None"]


@dataclass(frozen=True)
class Mutant:
    edits: tuple[Edit, ...]
    # the claim it breaks (a key of autograder.claims.CLAIMS), and what its failure must say
    claim: str
    says: str
    world: int = 2
    # the step the report's first line names, when not the claim's own (a crash's line)
    blame: str | None = None
    # the exception the report's first line names, for a mistake that crashes
    raises: str = ""
    # other claims the mistake breaks too (a test set evaluated twice over: an impossible count)
    also: tuple[str, ...] = ()

    @property
    def step(self) -> str:
        return self.blame or next(c.step for c in CLAIMS if c.key == self.claim)

    def opens(self, headline: str) -> bool:
        """Whether a report's first line names this mistake's step, cause and exception."""
        named = self.says in headline and self.raises in headline
        return headline.startswith(f"{self.step}: ") and named


SAVE = "            save_checkpoint(model.module, args.checkpoint)"
SAMPLER = "    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed)"
SPLIT_TEST = "    test_set = Subset(test_set, range(rank, len(test_set), world_size))"
TEST_LOADER = "    test_loader = DataLoader(test_set, 1000, **kwargs)"
SET_EPOCH = "        train_loader.sampler.set_epoch(epoch)"
WRAP = "    model = DDP(model, device_ids=ids)"
BARRIER = "        dist.barrier()  # step 5"
OPTIMIZER = "    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)"
TEST_SUMS = "        test = test_totals.tolist()"
TEST_REDUCE = "        dist.all_reduce(test_totals)  # step 3"

MUTANTS = {
    "loss divided by the world size": Mutant(
        (
            (
                "        loss = F.cross_entropy(logits, labels)",
                "        loss = F.cross_entropy(logits, labels) / dist.get_world_size()",
            ),
        ),
        "gradient",
        "the loss is divided by the world size",
        also=("loss",),
    ),
    "world size hard-coded in the sampler": Mutant(
        ((SAMPLER, SAMPLER.replace("world_size, rank", "2, rank")),),
        "run",
        "rank 2 of 3 crashed at line",
        world=3,
        blame="step 3",
        raises="ValueError: Invalid rank 2",
    ),
    "sampler seeded with the rank": Mutant(
        ((SAMPLER, SAMPLER.replace("seed=args.seed", "seed=args.seed + rank")),),
        "shards",
        "seeded differently",
    ),
    "training sampler with shuffle=False": Mutant(
        ((SAMPLER, SAMPLER.replace("seed=args.seed", "seed=args.seed, shuffle=False")),),
        "order",
        "does not shuffle",
    ),
    "progress bar object on rank 0 only": Mutant(
        (
            (
                "    bar = tqdm(loader, leave=False, disable=None if show_bar else True)",
                "    bar = tqdm(loader, leave=False) if show_bar else None",
            ),
            ("    for images, labels in bar:", "    for images, labels in bar or loader:"),
            (
                "        optimizer.step()",
                '        optimizer.step()\n        bar.set_postfix(loss=f"{loss.item():.3f}")',
            ),
        ),
        "run",
        "rank 1 of 2 crashed at line",
        raises="AttributeError: 'NoneType' object has no attribute 'set_postfix'",
    ),
    "checkpoint read back with no barrier": Mutant(
        (
            ("        # step 5: nobody reads the file before", None),
            (BARRIER, "        model.module.load_state_dict(torch.load(args.checkpoint))"),
        ),
        "read_after_write",
        "with no dist.barrier() after rank 0's torch.save",
    ),
    "no DDP wrap": Mutant(
        ((WRAP, None), (SAVE, SAVE.replace("model.module", "model"))),
        "gradient",
        "its own batch alone",
    ),
    "no set_epoch": Mutant(((SET_EPOCH, None),), "order", "set_epoch(epoch) on every rank"),
    "set_epoch(0)": Mutant(
        ((SET_EPOCH, SET_EPOCH.replace("(epoch)", "(0)")),), "order", "the same order"
    ),
    "no DistributedSampler": Mutant(
        (
            (SAMPLER, None),
            (
                "    train_loader = DataLoader(train_set, batch_size, sampler=sampler, **kwargs)",
                "    train_loader = DataLoader(train_set, batch_size, shuffle=True, **kwargs)",
            ),
            (SET_EPOCH, None),
        ),
        "shards",
        "no DistributedSampler",
    ),
    "test set not split": Mutant(
        ((SPLIT_TEST, None),), "test_shares", "the whole test set", also=("figures",)
    ),
    "test set split by a DistributedSampler": Mutant(
        (
            (SPLIT_TEST, None),
            (
                TEST_LOADER,
                "    test_sampler = DistributedSampler(test_set, world_size, rank, shuffle=False)"
                "\n    test_loader = DataLoader(test_set, 1000, sampler=test_sampler, **kwargs)",
            ),
        ),
        "test_shares",
        "pads the",
        also=("figures",),
    ),
    "training counts not summed": Mutant(
        (("        dist.all_reduce(totals)", None),),
        "counts",
        "rank 0's own counts",
        also=("loss",),
    ),
    "every rank saves": Mutant(
        (("        if rank == 0:  # step 5", None), (SAVE, SAVE[4:])),
        "checkpoint",
        "only rank 0 should write it",
    ),
    "checkpoint of the DDP wrapper": Mutant(
        ((SAVE, SAVE.replace("model.module", "model")),), "checkpoint", "'module.'"
    ),
    "no destroy_process_group": Mutant(
        (("    dist.destroy_process_group()  # step 1", None),),
        "group",
        "called dist.destroy_process_group()",
    ),
    "every rank prints": Mutant(
        (
            ("        if rank == 0:", None),
            (
                "            log(epoch_line(",
                "        log(epoch_line(epoch, args.epochs, train, test, seconds))",
            ),
        ),
        "printing",
        "only rank 0 should print them",
    ),
    "barrier on rank 0 only": Mutant(
        ((BARRIER, "            dist.barrier()  # step 5"),),
        "run",
        "rank 1 (last in dist.all_reduce() at line",
        blame="step 5",
    ),
    # Beyond the classic list: what the grader's invariants catch without naming the mistake.
    "set_epoch on rank 0 only": Mutant(
        ((SET_EPOCH, "        if rank == 0:\n    " + SET_EPOCH),),
        "shards",
        "different epochs",
    ),
    "gradients all-reduced by hand, not averaged": Mutant(
        (
            (WRAP, None),
            (SAVE, SAVE.replace("model.module", "model")),
            (
                "        loss.backward()",
                "        loss.backward()\n        for p in model.parameters():\n"
                "            dist.all_reduce(p.grad)",
            ),
        ),
        "gradient",
        "summed, not averaged",
    ),
    "sampler given rank 0 on every rank": Mutant(
        ((SAMPLER, SAMPLER.replace("world_size, rank", "world_size, 0")),),
        "shards",
        "every rank drew the same",
    ),
    # What training computes, beside what DDP computes: the figures, the batch, the mode, the
    # steps, the optimizer.
    "test counts not summed": Mutant(
        ((TEST_SUMS, "        test = [test_totals.tolist()[0], len(test_loader.dataset)]"),),
        "figures",
        "above 100%: ",
        world=3,
        also=("counts", "accuracy"),
    ),
    "batch split by the world size, lr scaled": Mutant(
        (
            ("    batch_size = args.batch_size", "    batch_size = args.batch_size // world_size"),
            (OPTIMIZER, OPTIMIZER.replace("lr=args.lr", "lr=args.lr * world_size")),
        ),
        "batches",
        "--batch-size is per process",
    ),
    "no model.train() in the epoch loop": Mutant(
        (("    model.train()", None),), "steps", "dropout was off while it trained"
    ),
    "gradients of 2 batches summed per step": Mutant(
        (
            ("    for images, labels in bar:", "    for step, (images, labels) in enumerate(bar):"),
            ("        optimizer.zero_grad(set_to_none=True)", None),
            (
                "        optimizer.step()",
                "        if step % 2 == 1:\n            optimizer.step()\n"
                "            optimizer.zero_grad(set_to_none=True)",
            ),
        ),
        "steps",
        "2 batches' gradients summed per step",
    ),
    "optimizer built on another model": Mutant(
        (
            (OPTIMIZER, None),
            (WRAP, f"{OPTIMIZER}\n    model = DDP(Net().to(device), device_ids=ids)"),
        ),
        "optimizer",
        "holds none of the 8 parameters of the DistributedDataParallel",
    ),
    "evaluation and its all_reduce on rank 0 only": Mutant(
        (
            (
                "        test_totals = evaluate(",
                "        if rank == 0:\n"
                "            test_totals = evaluate(model, test_loader, device)",
            ),
            (TEST_REDUCE, f"    {TEST_REDUCE}"),
            (TEST_SUMS, f"    {TEST_SUMS}"),
        ),
        "run",
        "called dist.all_reduce() at line",
        blame="step 3",
    ),
    "no DDP wrap, the save unwraps": Mutant(
        ((WRAP, None),),
        "gradient",
        "its own batch alone",
        raises="AttributeError: 'Net' object has no attribute 'module'",
    ),
    "ranks seeded apart, init_sync=False": Mutant(
        (
            ("    torch.manual_seed(args.seed)", "    torch.manual_seed(args.seed + rank)"),
            (WRAP, WRAP.replace("ids)", "ids, init_sync=False)")),
        ),
        "gradient",
        "init_sync=False) skips the copy",
        also=("in_sync",),
    ),
    # Causes named from what the records show: erased gradients, two wraps, a printed loss
    # that is not the computed one, learning rates or steps that differ between ranks, a
    # count summed twice.
    "zero_grad() between backward() and step()": Mutant(
        (
            ("        optimizer.zero_grad(set_to_none=True)", None),
            (
                "        loss.backward()",
                "        loss.backward()\n        optimizer.zero_grad(set_to_none=True)",
            ),
        ),
        "steps",
        "the gradients were erased between backward() and step()",
    ),
    "model wrapped twice": Mutant(
        ((WRAP, "    model = DDP(DDP(model, device_ids=ids), device_ids=ids)"),),
        "wrap",
        "wrapped its model twice, DDP(DDP(model))",
        also=("checkpoint",),
    ),
    "loss all-reduced in place before backward()": Mutant(
        (
            (
                "        loss = F.cross_entropy(logits, labels)",
                "        loss = F.cross_entropy(logits, labels)\n"
                "        dist.all_reduce(loss)  # the global loss, for the log",
            ),
        ),
        "loss",
        "times the mean, as if each batch's loss were summed over",
    ),
    "scheduler stepped on rank 0 only": Mutant(
        (("        scheduler.step()", "        if rank == 0:\n            scheduler.step()"),),
        "lr",
        "different learning rates at optimizer step",
        also=("in_sync",),
    ),
    "optimizer.step() on rank 0 only": Mutant(
        (
            (
                "        optimizer.step()",
                "        if dist.get_rank() == 0:\n            optimizer.step()",
            ),
        ),
        "optimizer",
        "skipped optimizer.step()",
        also=("steps", "lr", "in_sync"),
    ),
    "correct predictions summed twice": Mutant(
        ((TEST_REDUCE, f"{TEST_REDUCE}\n        dist.all_reduce(test_totals[:1])"),),
        "figures",
        "the count of correct predictions alone was summed more than once",
        world=3,
        also=("accuracy",),
    ),
    "a barrier on rank 0 after the epoch line": Mutant(
        (
            (
                "            log(epoch_line(",
                "            log(epoch_line(epoch, args.epochs, train, test, seconds))\n"
                "            dist.barrier()",
            ),
        ),
        "run",
        "called dist.barrier() at line",
    ),
    # Beyond what test_exercises.py plants: what the same claims catch.
    "no zero_grad()": Mutant(
        (("        optimizer.zero_grad(set_to_none=True)", None),),
        "steps",
        "Call optimizer.zero_grad() before each backward()",
    ),
    "evaluation in train mode": Mutant(
        (("    model.eval()", None),), "evaluation", "evaluated in train mode"
    ),
    "training totals all-reduced twice": Mutant(
        (
            (
                "        dist.all_reduce(totals)",
                "        dist.all_reduce(totals)\n        dist.all_reduce(totals)",
            ),
        ),
        "figures",
        "more than the train set can give",
        also=("counts",),
    ),
}


def plant(base: str, edits: tuple[Edit, ...], destination: Path) -> Path:
    """The solution `base` with the edits made, written to `destination`."""
    lines = (REPO / base).read_text().splitlines()
    for text, replacement in edits:
        hits = [n for n, line in enumerate(lines) if line == text]
        hits = hits or [n for n, line in enumerate(lines) if line.startswith(text)]
        assert len(hits) == 1, f"{base} has {len(hits)} lines that match {text!r}"
        if replacement is None:
            del lines[hits[0]]
        else:
            lines[hits[0]] = replacement
    destination.write_text("\n".join(lines) + "\n")
    return destination


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", choices=sorted(SOLUTIONS), default="torchrun")
    parser.add_argument("--quick", action="store_true", help="400 digits, 2 epochs")
    parser.add_argument("--only", nargs="+", choices=sorted(MUTANTS), metavar="MUTANT")
    parser.add_argument(
        "--untouched", action="store_true", help="grade the solution too, at 2 and 3 ranks"
    )
    parser.add_argument("--keep", type=Path, help="leave each run's folder (grade.log) here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    names = args.only or list(MUTANTS)
    epochs, digits = (2, (SMALL_TRAIN, SMALL_TEST)) if args.quick else (GRADE_EPOCHS, None)
    rows, wrong = [], 0
    # Too few digits and epochs to learn: the quick runs leave the accuracy out.
    ignored = {"accuracy"} if args.quick else set()
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        scratch = args.keep or Path(scratch)
        full = get_mnist_subset.write_mnist(scratch / "mnist")
        train_digits, test_digits = digits or (TRAIN_DIGITS, GRADED_TEST)
        data = first_digits(full, scratch / "data", train_digits, test_digits)
        cases = [(name, MUTANTS[name], MUTANTS[name].world) for name in names]
        if args.untouched:
            cases = [("untouched", None, 2), ("untouched", None, 3), *cases]
        for n, (name, mutant, world) in enumerate(tqdm(cases, desc="mutants", unit="run")):
            folder = scratch / f"{n:02d}-{name.replace(' ', '-').replace('/', '-')}"
            (folder / "probe").mkdir(parents=True)
            script = SOLUTIONS[args.base]
            if mutant:
                script = plant(script, mutant.edits, folder / "mutant.py")
            target = Target(args.base, str(script), world)
            training = train(
                target, data, folder, folder / "probe", epochs, (train_digits, test_digits)
            )
            findings = grade(training)
            write_log(findings, training)
            failed = [f for f in failing(findings).values() if f.claim.key not in ignored]
            verdict = failed[0].headline.split(":")[0] if failed else "pass"
            first = failed[0].headline if failed else "every claim checked holds"
            expected = mutant.opens(first) if mutant else not failed
            wrong += not expected
            rows.append((name, world, verdict, "yes" if expected else "NO", first))
    width = max(len(row[0]) for row in rows)
    print(f"\n{'mutant':{width}}  ranks  verdict  expected  first line of the report")
    for name, world, verdict, expected, first in rows:
        print(f"{name:{width}}  {world:5}  {verdict:7}  {expected:8}  {first}")
    print(f"\n{len(rows) - wrong} of {len(rows)} graded as expected")
    if args.keep:
        print(f"each run's grade.log and probe records: {args.keep}/NN-<mutant>/")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
