"""Part 4: a first-run sanity check for a new machine or cluster, before any training.

Run it the way you will run training. Every rank prints a `start` line as soon as it knows who
it is (so a hang shows who never arrived), then the ranks look up the meeting point
(MASTER_ADDR), meet, check an all_reduce and a barrier, and rank 0 prints one `report` line per
rank: who is who (its node, its Slurm task, rank, local rank, device), backend and versions.
If a step fails, the rank prints one `FAILED` line first (the step, its rank and host, the
error's first line), then what to check, then the detail (the error in full and what the
libraries wrote meanwhile), and exits with status 1 so that the launcher ends the whole job.

The launcher is found as in part4_torchrun/train.py: torchrun if RANK is set; an srun step if
SLURM_STEP_ID is set (then the job script must export MASTER_ADDR and MASTER_PORT, as the
job_srun_*.sbatch scripts do, and srun needs --ntasks-per-node); otherwise a world of one
process, also inside a batch script.

    python part4_torchrun/tools/diagnose.py
    torchrun --standalone --nproc_per_node=2 part4_torchrun/tools/diagnose.py
    NCCL_DEBUG=INFO torchrun --standalone --nproc_per_node=2 \
        part4_torchrun/tools/diagnose.py --timeout 30
    # on Slurm, under srun and then under torchrun, as the job scripts train:
    sbatch part4_torchrun/tools/job_diagnose.sbatch
"""

import argparse
import contextlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

# What to check when a step fails, the likeliest first.
HINTS = {
    "launcher environment": [
        "torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT",
        "srun sets SLURM_STEP_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and, with"
        " --ntasks-per-node, SLURM_NTASKS_PER_NODE; the job script exports MASTER_ADDR and"
        " MASTER_PORT",
        "inside srun, use one launcher: `srun python ...`, or `srun torchrun ...` with"
        " --ntasks-per-node=1",
    ],
    "device": [
        "CUDA_VISIBLE_DEVICES and `nvidia-smi`: does this node have a GPU for every local rank?",
        "Slurm: --gpus-per-node must be >= --ntasks-per-node (one GPU per process)",
        "use --device cpu to test the network with gloo, without GPUs",
    ],
    "master address": [
        "MASTER_ADDR must name the first node so that every node can look it up: the job"
        ' scripts take it from `scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p`',
        "try `getent hosts $MASTER_ADDR` on each node; a typo or a login-node-only name fails",
    ],
    "init_process_group": [
        "did every rank start? count the `start` lines: WORLD_SIZE must equal the processes",
        "MASTER_ADDR must be reachable from every node (ping it); MASTER_PORT must be free and"
        " not firewalled",
        "several network interfaces? pick one: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"
        " (see `ip addr`)",
        "NCCL_DEBUG=INFO prints what NCCL tried; --timeout shortens the wait",
        "on GPUs this step also creates NCCL's communicator (device_id=): NCCL errors show here",
    ],
    "all_reduce": [
        "NCCL_DEBUG=INFO shows the transport NCCL chose between GPUs and nodes",
        "`nvidia-smi topo -m` shows how the GPUs are connected (NVLink, PCIe, across sockets)",
        "try NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1 to rule out one transport",
    ],
    "gather reports": [
        "a rank that died or hangs here failed after the all_reduce: look at its own output"
    ],
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
    parser.add_argument(
        "--timeout",
        type=int,
        default=int(os.environ.get("DDP_TIMEOUT_S", 300)),
        help="seconds to wait for the other ranks (default: $DDP_TIMEOUT_S, else 300)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def find_free_port() -> int:
    # Port 0: the OS picks a free one.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_launcher_env() -> tuple[str, int, int, int, int]:
    """(launcher, rank, local rank, world size, local world size)."""
    env = os.environ
    # torchrun; also inside srun, where torchrun's variables must win.
    if "RANK" in env:
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        return "torchrun", rank, local_rank, int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    # An srun step, one task per process. The batch script itself has SLURM_PROCID but no
    # step: a plain python there is a world of one.
    # The same needs as train.py's, so that a layout it refuses fails here too.
    if "SLURM_STEP_ID" in env:
        needs = ["MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS_PER_NODE"]
        lacking = [name for name in needs if not env.get(name)]
        if lacking:
            sys.exit(
                f"error: under srun, set {lacking}: export MASTER_ADDR and MASTER_PORT in the"
                ' job script, e.g. MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST"'
                ' | sed -n 1p)" and MASTER_PORT=$((15000 + SLURM_JOB_ID % 1700 * 10)), and give'
                " srun --ntasks-per-node"
            )
        world_size, local_world_size = int(env["SLURM_NTASKS"]), int(env["SLURM_NTASKS_PER_NODE"])
        rank, local_rank = int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"])
        return "srun", rank, local_rank, world_size, local_world_size
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(find_free_port()))
    return "python", 0, 0, 1, 1


def pick_device(choice: str, local_rank: int) -> torch.device:
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        raise RuntimeError(f"local rank {local_rank} but only {gpus} visible GPU(s)")
    # Before any CUDA work or collective: else every rank's "cuda" is GPU 0, and NCCL, which
    # creates its communicator at the first collective, would put every rank on GPU 0.
    torch.cuda.set_device(local_rank)
    return torch.device(f"cuda:{local_rank}")


def identity(
    launcher: str, rank: int, world_size: int, local_rank: int, device, backend: str
) -> dict:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "none"
    host = socket.gethostname()
    in_step = "SLURM_STEP_ID" in os.environ
    return {
        "launcher": launcher,
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        # Slurm's name for the node (several "nodes" may share one host, as on the local
        # test cluster); the host elsewhere
        "node": os.environ.get("SLURMD_NODENAME", host),
        # the srun task this process belongs to: itself under srun, its node's torchrun
        # under srun + torchrun (whose workers inherit the task's SLURM_PROCID)
        "task": os.environ["SLURM_PROCID"] if in_step else "-",
        "host": host,
        "device": str(device),
        "backend": backend,
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda or "none",
        "gpus": torch.cuda.device_count(),
        "nccl": nccl,
        "python": platform.python_version(),
    }


def describe(info: dict) -> str:
    return (
        f"launcher={info['launcher']} node={info['node']} task={info['task']}"
        f" rank={info['rank']}/{info['world_size']} local_rank={info['local_rank']}"
        f" host={info['host']} device={info['device']} backend={info['backend']}"
        f" torch={info['torch']} cuda_build={info['cuda_build']} gpus={info['gpus']}"
        f" nccl={info['nccl']} python={info['python']}"
    )


def look_up(address: str, port: str) -> None:
    # Fails at once for a name that does not resolve, which init_process_group would try
    # again and again until --timeout runs out.
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        why = getattr(error, "strerror", None) or error
        raise RuntimeError(f"MASTER_ADDR {address!r} does not resolve here ({why})") from None


@contextlib.contextmanager
def stderr_held(held):
    """Whatever is written to file descriptor 2 meanwhile (c10d's C++ warnings at each retry,
    Python's too) goes to the file `held`, so that a failure's summary can come before it."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(held.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def explain(failure: StepFailed, rank: int | None, held) -> None:
    # Summary first, one line: the step, who failed where, the error's first line; then what
    # to check; then the detail: the error in full and the libraries' messages of the step.
    who = f"rank={rank if rank is not None else '?'} host={socket.gethostname()}"
    first, _, rest = str(failure).partition("\n")
    log(f"FAILED step={failure.step} {who}: {first}")
    for hint in HINTS[failure.step]:
        log(f"  check: {hint}")
    topology = shutil.which("nvidia-smi")
    if topology and failure.step in ("device", "all_reduce"):
        result = subprocess.run([topology, "topo", "-m"], capture_output=True, text=True)
        log("  nvidia-smi topo -m:\n" + result.stdout.rstrip())
    held.seek(0)
    detail = (rest.strip() + "\n" + held.read().decode(errors="replace")).strip()
    if detail:
        log("detail (the full error, then what the libraries wrote during the checks):")
        log("\n".join(f"  {line}" for line in detail.splitlines()))


def run_checks(args: argparse.Namespace) -> int:
    rank = None
    with tempfile.TemporaryFile() as held:
        try:
            with step("launcher environment"):
                launcher, rank, local_rank, world_size, local_world_size = read_launcher_env()
            with step("device"):
                device = pick_device(args.device, local_rank)
            backend = "nccl" if device.type == "cuda" else "gloo"
            me = identity(launcher, rank, world_size, local_rank, device, backend)
            master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            log(f"start {describe(me)} master={master}")
            if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
                # The processes on this machine share its cores.
                torch.set_num_threads(max(1, torch.get_num_threads() // local_world_size))
            with step("master address"):
                look_up(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
            with stderr_held(held):
                reports, value, expected = meet(args, rank, local_rank, world_size, device, me)
        except StepFailed as failure:
            explain(failure, rank, held)
            return 1
        # All went well: what the libraries wrote meanwhile (warnings), where it was going.
        held.seek(0)
        sys.stderr.buffer.write(held.read())
        sys.stderr.flush()
    if rank == 0:
        log(f"all_reduce ok: sum={value.item():g} expected={expected:g}")
        log("barrier ok")
        for info in reports:
            log(f"report {describe(info)}")
        if len({(r["torch"], r["cuda_build"], r["nccl"]) for r in reports}) > 1:
            log("WARNING: ranks run different torch/CUDA/NCCL versions: use one environment")
        nodes = sorted({r["node"] for r in reports})
        log(
            f"OK {world_size} rank(s) on {len(nodes)} node(s) ({','.join(nodes)}) backend={backend}"
        )
    dist.destroy_process_group()
    return 0


def meet(args, rank: int, local_rank: int, world_size: int, device, me: dict) -> tuple:
    """The collective steps: (every rank's identity, the all_reduce's sum, the expected sum)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with step("init_process_group"):
        # device_id binds the group to this GPU, and NCCL then creates its communicator
        # here (without it: at the first collective), so that an NCCL failure is reported
        # at this step. On CPUs it is left out. (init_process_group's documentation:
        # https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group)
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=args.timeout),
            device_id=device if device.type == "cuda" else None,
        )
    with step("all_reduce"):
        value = torch.tensor([rank + 1.0], device=device)
        # 1 + 2 + ... + world_size
        dist.all_reduce(value)
        expected = world_size * (world_size + 1) / 2
        if value.item() != expected:
            raise RuntimeError(f"sum is {value.item()}, expected {expected}")
    with step("gather reports"):
        reports = [None] * world_size
        dist.all_gather_object(reports, me)
    with step("barrier"):
        dist.barrier(device_ids=[local_rank] if backend == "nccl" else None)
    return reports, value, expected


if __name__ == "__main__":
    sys.exit(run_checks(parse_args()))
