"""Does step 3's overlap pay? Time its training step three ways, in one run.

    torchrun --standalone --nproc_per_node=2 \\
        part4_torchrun/beyond_ddp/overlap_bench.py --sizes 1,8,16,64

Each step is timed whole (forward, backward, all-reduces, Adam's step), the
variants in turns (in reverse order every other step) so that a change in the
machine's load, or a cost one variant leaves to the next, hits them alike:
- overlap: step 3's buckets, each sent as soon as its last gradient is in;
- after: step 2's buckets, the same ones, all-reduced once backward() ends;
- compute: no all-reduce at all (the ranks drift apart; only time counts).
Rank 0 prints the median of each, after / overlap (the speedup) and the share
of the exposed communication (after - compute) that overlapping hid. A size
that holds the whole model makes one bucket, full only when backward() ends:
there overlap and after do the same thing, and their ratio shows the noise.

With --timeline, one step of after and of overlap at the first size (on each
rank, its timed step of median length) is also printed as a timeline, each
rank's own clock from the step's start:
`timeline variant=V rank=R what=W [bucket=B] start_ms=S end_ms=E` for the
forward, backward(), each bucket's all-reduce, the wait for the sums
(average_gradients()) and the optimizer's step. figures/draw_overlap.py draws
it.
"""

import argparse
import os
import statistics
import time
from contextlib import contextmanager, nullcontext
from itertools import pairwise

import torch
import torch.distributed as dist
import torch.nn.functional as F
import step2_buckets
import step3_hooks
from step3_hooks import batch, build_model, log, start_group


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,16,64", help="bucket MB")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", action="store_true", help="see above")
    # step 3's plain MLP (its --model mixed is for the tests)
    parser.set_defaults(model="mlp")
    args = parser.parse_args()
    try:
        args.sizes = [float(mb) for mb in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: numbers of MB, comma-separated: {args.sizes}")
    if min(args.steps, args.batch_size, args.width, args.depth) < 1:
        parser.error("--steps, --batch-size, --width and --depth must be >= 1")
    if min(args.sizes) <= 0:
        parser.error("--sizes must be > 0")
    return args


@contextmanager
def all_reduces_timed(events: list):
    """Records when each dist.all_reduce starts and ends, in `events`: an
    asynchronous one (step 3's) ends when gloo completes its future, a
    blocking one (step 2's) when the call returns."""
    original, chained = dist.all_reduce, []

    def timed(tensor, *args, async_op=False, **kwargs):
        row = [time.perf_counter(), None]
        events.append(row)
        work = original(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            row[1] = time.perf_counter()
            return work

        def done(future):
            row[1] = time.perf_counter()
            return future.value()

        chained.append(work.get_future().then(done))
        return work

    dist.all_reduce = timed
    try:
        yield
    finally:
        dist.all_reduce = original
        for future in chained:
            future.wait()


def train_step(model, optimizer, buckets, images, labels) -> list[float]:
    """One training step; the clock at its start and after each part: the
    forward, backward(), the wait for the sums, the optimizer's step."""
    marks = [time.perf_counter()]
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    if buckets:
        buckets.average_gradients()
        # step 3's hooks would fire in the next variant's backward()
        for hook in getattr(buckets, "hooks", []):
            hook.remove()
    marks.append(time.perf_counter())
    optimizer.step()
    marks.append(time.perf_counter())
    return marks


def spans(marks: list[float], reduces: list) -> list[tuple]:
    """(what, bucket, start_ms, end_ms), from the step's start."""
    names = ("forward", "backward", "wait", "step")
    rows = [
        (n, None, *span)
        for n, span in zip(names, pairwise(marks), strict=True)
    ]
    rows += [("bucket", i, s, e) for i, (s, e) in enumerate(reduces)]
    ms = [
        (n, b, 1000 * (s - marks[0]), 1000 * (e - marks[0]))
        for n, b, s, e in rows
    ]
    return ms


def main(args: argparse.Namespace) -> None:
    rank, world_size, device = start_group()
    torch.manual_seed(args.seed)
    model = build_model(args).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    variants = [
        (mb, overlap) for mb in args.sizes for overlap in (False, True)
    ]
    seconds = {variant: [] for variant in [*variants, None]}
    counts, timelines = {}, {}
    # Step 0 warms up (memory, threads) and is not counted. Every other step
    # runs the variants in reverse: none always follows the same one.
    for step in range(args.steps + 1):
        for variant in list(seconds)[:: -1 if step % 2 else 1]:
            buckets = None
            if variant:
                mb, overlap = variant
                kind = step3_hooks if overlap else step2_buckets
                buckets = kind.ByHandDDP(model, mb)
                counts[mb] = len(buckets.buckets)
            images, labels = batch(args, step, rank, world_size, device)
            # the timeline: after and overlap at the first size, timed steps
            first = [(args.sizes[0], False), (args.sizes[0], True)]
            record = args.timeline and step > 0 and variant in first
            reduces = []
            timed = all_reduces_timed(reduces) if record else nullcontext()
            dist.barrier()
            with timed:
                marks = train_step(model, optimizer, buckets, images, labels)
            if step:
                seconds[variant].append(marks[-1] - marks[0])
            if record:
                name = "overlap" if variant[1] else "after"
                took = marks[-1] - marks[0]
                timelines.setdefault(name, []).append(
                    (took, spans(marks, reduces))
                )
    # each rank's step of median length, of each variant
    for name, steps in timelines.items():
        timelines[name] = sorted(steps)[len(steps) // 2][1]
    every = [None] * world_size
    dist.all_gather_object(every, timelines)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        log(
            f"machine cpus={os.cpu_count()} torch={torch.__version__}"
            f" backend={dist.get_backend()} world_size={world_size}"
            f" threads={torch.get_num_threads()} device={device}"
            f" params={params} steps={args.steps}"
        )
        ms = {v: 1000 * statistics.median(s) for v, s in seconds.items()}
        for mb in args.sizes:
            after, overlap, compute = ms[mb, False], ms[mb, True], ms[None]
            # What overlapping saved, as a share of what communication cost.
            hidden = "n/a"
            if after > compute:
                hidden = f"{100 * (after - overlap) / (after - compute):.0f}%"
            log(
                f"bench bucket_mb={mb:g} buckets={counts[mb]}"
                f" after_ms={after:.2f} overlap_ms={overlap:.2f}"
                f" compute_ms={compute:.2f} speedup={after / overlap:.3f}"
                f" hidden={hidden}"
            )
        for name in ("after", "overlap"):
            for r, rows in enumerate(every):
                for what, bucket, begin, end in rows.get(name, []):
                    index = "" if bucket is None else f" bucket={bucket}"
                    log(
                        f"timeline variant={name} rank={r} what={what}{index}"
                        f" start_ms={begin:.3f} end_ms={end:.3f}"
                    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
