"""Your own script: a seed drawn at random in each process. See README.md.

Many scripts draw a seed when none is given:
`seed = args.seed if args.seed is not None else random.randint(1, 10000)`.
Under torchrun every process draws its own, so each rank's DistributedSampler
shuffles the data set in another order, and the shards overlap: some samples
go to both ranks in an epoch, as many to none. With --fix every rank takes
rank 0's seed, broadcast right after init_process_group.

    torchrun --standalone --nproc_per_node=2 random_seed.py
    torchrun --standalone --nproc_per_node=2 random_seed.py --fix
    torchrun --standalone --nproc_per_node=2 random_seed.py --show-shards
"""

import argparse
import random
import sys
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES = 128


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="every rank takes rank 0's seed"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="default: drawn at random"
    )
    parser.add_argument(
        "--show-shards",
        action="store_true",
        help="print each rank's samples, in the order drawn",
    )
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The single-device habit. Python's random is seeded from the operating
    # system when it is imported: each process draws another seed.
    seed = args.seed if args.seed is not None else random.randint(1, 10000)
    if args.fix:
        # --fix: every rank takes rank 0's seed, before anything uses it
        agreed = [seed]
        dist.broadcast_object_list(agreed, src=0)
        seed = agreed[0]
    log(f"rank={rank} seed={seed}")

    # One epoch of a shuffled shard, as the training loop would draw it.
    dataset = TensorDataset(torch.arange(SAMPLES))
    sampler = DistributedSampler(dataset, seed=seed)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    sampler.set_epoch(0)
    mine = [int(i) for (batch,) in loader for i in batch]
    shards = [None] * world_size
    dist.all_gather_object(shards, mine)
    if rank == 0 and args.show_shards:
        for other, shard in enumerate(shards):
            log(f"rank={other} shard={','.join(map(str, shard))}")
    if rank == 0:
        # how many ranks drew each sample (twice in one shard counts once)
        ranks = Counter(i for shard in shards for i in set(shard))
        on_both = sum(1 for count in ranks.values() if count > 1)
        log(
            f"samples={SAMPLES} on_both_ranks={on_both}"
            f" on_no_rank={SAMPLES - len(ranks)}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
