"""A hang with no error: a collective that only one rank calls.

Each rank counts its correct answers on its shard of a test set; the global
accuracy needs an all_reduce of the counts. The bug: the all_reduce sits
inside `if rank == 0:`, next to the print. Rank 0 waits in the all_reduce,
rank 1 in the barrier that follows, each for the other: nothing moves and
nothing is printed until the collective timeout (--timeout) ends it:

    RuntimeError: [.../gloo/transport/tcp/unbound_buffer.cc:...] Timed out
    waiting 5000ms for recv operation to complete

Four ways to see which rank is where:
- the timeout's traceback names the line each rank waits in; torchrun's
  report shows it when the entry point is wrapped in @record (below);
- TORCH_DISTRIBUTED_DEBUG=DETAIL checks that all ranks call the same
  collective before each one, and turns the hang into an error at once:
  "Detected mismatch between collectives on ranks". Each rank's own call
  and traceback in it are right; the other rank's call it names may not be
  (README);
- the Flight Recorder, which records every gloo collective by default in
  torch 2.15 (TORCH_FR_BUFFER_SIZE, 2000 entries): with --fr-dump DIR each
  rank writes its record when its collective fails, and prints its last
  collective, its sequence number and the script's line;
- py-spy dump --pid PID prints a running process's Python stack (not run
  here; https://github.com/benfred/py-spy).

    torchrun --standalone --nproc_per_node=2 part4_torchrun/errors/hang.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 \
        part4_torchrun/errors/hang.py
    torchrun --standalone --nproc_per_node=2 part4_torchrun/errors/hang.py \
        --fr-dump fr_hang
    torchrun --standalone --nproc_per_node=2 part4_torchrun/errors/hang.py \
        --fix

--fix: every rank calls the all_reduce; only rank 0 prints.

Evidence lines (rank 0 with --fix; each rank with --fr-dump):
    accuracy correct=67 total=128 acc=52.34%
    flight_recorder rank=1 last=gloo:barrier seq=1 line=126 entries=1
"""

import argparse
import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="every rank calls the all_reduce"
    )
    parser.add_argument(
        "--timeout", type=float, default=5, help="collective timeout, s"
    )
    parser.add_argument(
        "--fr-dump",
        metavar="DIR",
        help="on a failed collective, write each rank's Flight Recorder here",
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def evaluate(rank: int, world_size: int) -> torch.Tensor:
    """(correct, total) on this rank's shard: 128 samples, a fixed
    classifier that is right about half the time."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=generator)
    labels = torch.randint(0, 2, (128,), generator=generator)
    weight = torch.randn(8, 2, generator=generator)
    shard = slice(rank, None, world_size)
    predictions = (x[shard] @ weight).argmax(1)
    correct = (predictions == labels[shard]).sum()
    return torch.stack([correct, torch.tensor(len(predictions))])


def dump_flight_recorder(folder: str, rank: int) -> None:
    """Write this rank's Flight Recorder (its last collectives, with the
    Python stack of each call) as torch's pickle, and print the last one."""
    # A private function: torch 2.15 dumps gloo's record on request only.
    trace = torch._C._distributed_c10d._dump_fr_trace(
        includeCollectives=True, includeStackTraces=True, onlyActive=False
    )
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, f"rank_{rank}").write_bytes(trace)
    entries = pickle.loads(trace)["entries"]
    last = entries[-1]
    # The innermost frame in this script: the line that called it.
    here = os.path.abspath(__file__)
    line = next(f for f in last["frames"] if f["filename"] == here)
    log(
        f"flight_recorder rank={rank} last={last['profiling_name']}"
        f" seq={last['collective_seq_id']} line={line['line']}"
        f" entries={len(entries)}"
    )


def count_and_wait(args, rank: int, world_size: int) -> None:
    counts = evaluate(rank, world_size)
    if args.fix:
        # fix: a collective is called by every rank; printing is rank 0's
        dist.all_reduce(counts)
    if rank == 0:
        if not args.fix:
            # The bug: only rank 0 gets here.
            dist.all_reduce(counts)
        correct, total = counts.tolist()
        log(
            f"accuracy correct={correct} total={total}"
            f" acc={100 * correct / total:.2f}%"
        )
    # Every rank waits here before rank 0 would save a checkpoint.
    dist.barrier()


# @record: a rank's uncaught exception is written to a file that torchrun
# reads, and its report shows that rank's traceback ("Root Cause") instead
# of only an exit code.
@record
def main() -> None:
    args = parse_args()
    # torchrun tells each process who it is.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A collective that waits this long fails instead of hanging (PyTorch's
    # default is 30 minutes for gloo, 10 for NCCL).
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        count_and_wait(args, rank, world_size)
    except RuntimeError:
        if args.fr_dump:
            dump_flight_recorder(args.fr_dump, rank)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
