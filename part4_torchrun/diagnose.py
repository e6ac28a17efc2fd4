"""Part 4: a first-run sanity check for a new machine or cluster, before any training.

Run it the way you will run training. Every rank prints a `start` line as soon as it knows
who it is (so a hang shows who never arrived), then the ranks meet, check an all_reduce and
a barrier, and rank 0 prints one `report` line per rank: host, rank, local rank, device,
backend and versions. If a step fails, the rank says which step and what to check, and
exits with status 1 so that the launcher ends the whole job.

    python part4_torchrun/diagnose.py
    torchrun --standalone --nproc_per_node=2 part4_torchrun/diagnose.py
    srun --ntasks=2 python part4_torchrun/diagnose.py
    NCCL_DEBUG=INFO torchrun --standalone --nproc_per_node=2 part4_torchrun/diagnose.py --timeout 30
"""

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

HINTS = {
    "launcher environment": [
        "torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
        "srun sets SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS; MASTER_ADDR comes from `scontrol show hostnames`",
        "inside srun, use one launcher: either `srun python ...` or `srun torchrun ...` with --ntasks-per-node=1",
    ],
    "device": [
        "CUDA_VISIBLE_DEVICES and `nvidia-smi`: does this node have a GPU for every local rank?",
        "Slurm: --gpus-per-node must be >= --ntasks-per-node (one GPU per process)",
        "use --device cpu to test the network with gloo, without GPUs",
    ],
    "init_process_group": [
        "did every rank start? count the `start` lines: WORLD_SIZE must equal the number of processes",
        "MASTER_ADDR must be reachable from every node (ping it); MASTER_PORT must be free and not firewalled",
        "several network interfaces? pick one: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (see `ip addr`)",
        "NCCL_DEBUG=INFO prints what NCCL tried; --timeout shortens the wait",
    ],
    "all_reduce": [
        "NCCL_DEBUG=INFO shows the transport NCCL chose between GPUs and nodes",
        "`nvidia-smi topo -m` shows how the GPUs are connected (NVLink, PCIe, across sockets)",
        "try NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1 to rule out one transport",
    ],
    "gather reports": ["a rank that died or hangs here failed after the all_reduce: look at its own output"],
    "barrier": ["a rank that never reaches the barrier is stuck or dead: look at its last lines"],
}


class StepFailed(Exception):
    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.step = step


@contextlib.contextmanager
def step(name: str):
    """Names the step in any failure inside it."""
    try:
        yield
    except Exception as error:
        raise StepFailed(name, error) from error


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for the other ranks")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return parser.parse_args()


def log(message: str) -> None:
    sys.stdout.write(message + "\n")  # one write per line: ranks never glue lines together
    sys.stdout.flush()


def find_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_launcher_env() -> tuple[str, int, int, int]:
    """(launcher, rank, local rank, world size), as part4_torchrun/train.py reads them."""
    env = os.environ
    if "RANK" in env:  # torchrun (its variables win inside srun too)
        return "torchrun", int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env:
        if "MASTER_ADDR" not in env:
            nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                                   capture_output=True, text=True, check=True)
            env["MASTER_ADDR"] = nodes.stdout.split()[0]
        env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 20000))
        return "srun", int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]), int(env["SLURM_NTASKS"])
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(find_free_port()))
    return "python", 0, 0, 1


def pick_device(choice: str, local_rank: int) -> torch.device:
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"local rank {local_rank} but only {torch.cuda.device_count()} visible GPU(s)")
    torch.cuda.set_device(local_rank)  # before init_process_group
    return torch.device(f"cuda:{local_rank}")


def identity(rank: int, world_size: int, local_rank: int, device: torch.device, backend: str) -> dict:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "none"
    return {"rank": rank, "world_size": world_size, "local_rank": local_rank, "host": socket.gethostname(),
            "device": str(device), "backend": backend, "torch": torch.__version__,
            "cuda_build": torch.version.cuda or "none", "gpus": torch.cuda.device_count(), "nccl": nccl, "python": platform.python_version()}


def describe(info: dict) -> str:
    return (f"rank={info['rank']}/{info['world_size']} local_rank={info['local_rank']} host={info['host']}"
            f" device={info['device']} backend={info['backend']} torch={info['torch']} cuda_build={info['cuda_build']}"
            f" gpus={info['gpus']} nccl={info['nccl']} python={info['python']}")


def explain(failure: StepFailed, rank: int | None) -> None:
    log(f"FAILED step={failure.step} rank={rank if rank is not None else '?'} error={failure}")
    for hint in HINTS[failure.step]:
        log(f"  check: {hint}")
    topology = shutil.which("nvidia-smi")
    if topology and failure.step in ("device", "all_reduce"):
        result = subprocess.run([topology, "topo", "-m"], capture_output=True, text=True)
        log("  nvidia-smi topo -m:\n" + result.stdout.rstrip())


def run_checks(args: argparse.Namespace) -> int:
    rank = None
    try:
        with step("launcher environment"):
            launcher, rank, local_rank, world_size = read_launcher_env()
        with step("device"):
            device = pick_device(args.device, local_rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        me = identity(rank, world_size, local_rank, device, backend)
        log(f"start launcher={launcher} {describe(me)} master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # a check, not a workload: do not oversubscribe the cores
        with step("init_process_group"):
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=args.timeout))
        with step("all_reduce"):
            value = torch.tensor([rank + 1.0], device=device)
            dist.all_reduce(value)  # 1 + 2 + ... + world_size
            expected = world_size * (world_size + 1) / 2
            if value.item() != expected:
                raise RuntimeError(f"sum is {value.item()}, expected {expected}")
        with step("gather reports"):
            reports = [None] * world_size
            dist.all_gather_object(reports, me)
        with step("barrier"):
            dist.barrier(device_ids=[local_rank] if backend == "nccl" else None)
    except StepFailed as failure:
        explain(failure, rank)
        return 1
    if rank == 0:
        log(f"all_reduce ok: sum={value.item():g} expected={expected:g}")
        log("barrier ok")
        for info in reports:
            log(f"report {describe(info)}")
        if len({(r["torch"], r["cuda_build"], r["nccl"]) for r in reports}) > 1:
            log("WARNING: ranks run different torch/CUDA/NCCL versions: use one environment on every node")
        hosts = sorted({r["host"] for r in reports})
        log(f"OK {world_size} rank(s) on {len(hosts)} host(s) ({','.join(hosts)}) backend={backend}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_checks(parse_args()))
