"""Every rank loads a checkpoint saved on GPU 0, without map_location.

torch.save records, with each tensor, the device it was on: "cuda:0" for a
checkpoint that rank 0 saved from its GPU. torch.load puts every tensor back
on that device unless map_location says otherwise, so when every rank loads
the file (to resume), every rank's copy lands on GPU 0: N copies of the
checkpoint there at once, and a CUDA context on GPU 0 in every rank's
process. load_state_dict then copies the values into the rank's own
parameters (param.copy_), so each rank still trains on its own GPU: the
cost is memory on GPU 0, not speed. On a machine without a GPU the load
fails:

    RuntimeError: Attempting to deserialize object on a CUDA device but
    torch.cuda.is_available() is False.

This script must run without a GPU too, so rank 0 saves CPU tensors and
labels them "cuda:0", as torch.save does for a tensor on GPU 0 (a tagger
registered with torch.serialization.register_package). Each rank first reads
the labels with a map_location function, which shows where a load without
map_location would put them, and how many bytes.

    python part4_torchrun/errors/load_every_rank.py
    python part4_torchrun/errors/load_every_rank.py --fix

--fix: torch.load(..., map_location=device), each rank's own device
(cuda:LOCAL_RANK on GPUs, cpu here).

Evidence lines (one per rank):
    saved rank=1 saved_on=cuda:0 bytes=272
    loaded rank=1 device=cpu equal=True
"""

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD_SIZE = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="load with map_location"
    )
    parser.add_argument(
        "--timeout", type=float, default=5, help="collective timeout, s"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def label_as_gpu0(storage) -> str | None:
    # The label torch.save writes for a tensor on GPU 0.
    return "cuda:0" if storage.device.type == "cpu" else None


def worker(
    rank: int, world_size: int, rendezvous: str, path: str, args
) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    if rank == 0:
        # Tried before the default taggers (lower priority number first).
        torch.serialization.register_package(
            0, label_as_gpu0, lambda s, _: None
        )
        torch.save(model.state_dict(), path)
    # The others read the file only once it is written.
    dist.barrier()

    # Where each tensor was saved (the location map_location receives), and
    # the bytes a load without map_location would allocate there.
    saved = {}

    def note(storage, location: str):
        saved[location] = saved.get(location, 0) + storage.nbytes()
        return storage

    torch.load(path, map_location=note)
    log(
        f"saved rank={rank} saved_on={','.join(sorted(saved))}"
        f" bytes={sum(saved.values())}"
    )

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    else:
        device = torch.device("cpu")
    if args.fix:
        # fix: each rank maps the tensors onto its own device
        state = torch.load(path, map_location=device)
    else:
        # Without map_location: the saved device, GPU 0 for every rank.
        state = torch.load(path)
    where = {str(t.device) for t in state.values()}
    model.load_state_dict(state)
    equal = all(
        torch.equal(state[k].cpu(), v) for k, v in model.state_dict().items()
    )
    log(f"loaded rank={rank} device={','.join(sorted(where))} equal={equal}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    # fork: the ranks inherit the imported torch and start at once (Linux;
    # CPU only: with GPUs, spawn).
    method = "fork" if sys.platform == "linux" else "spawn"
    # The ranks meet through a file (init_method="file://..."): no port to
    # pick, so no clash with another job on the machine.
    with tempfile.TemporaryDirectory() as directory:
        rendezvous = "file://" + os.path.join(directory, "rendezvous")
        path = os.path.join(directory, "checkpoint.pt")
        mp.start_processes(
            worker,
            (WORLD_SIZE, rendezvous, path, args),
            nprocs=WORLD_SIZE,
            start_method=method,
        )
