"""Test probe: records what each process of a real training run does. Not part of the course.

The tests put this folder on PYTHONPATH and set DDP_PROBE_DIR. Python imports
`sitecustomize` at start-up in every process (mp.spawn children, torchrun workers, srun
tasks), so the teaching scripts run unmodified under their real launchers while each
process writes, to DDP_PROBE_DIR/<pid>.jsonl:

- {"event": "init", "rank", "world_size", "backend"}  after init_process_group
- {"event": "batch", "loader", "pass", "indices"}    every batch of sample indices a loader drew
- {"event": "final", "rank", "threads"}  at destroy_process_group; the parameters of the first
                                           optimizer (the model being trained) go to <pid>.params.pt
"""

import json
import os

PROBE_DIR = os.environ.get("DDP_PROBE_DIR")


def inject_fault(loader, pass_number: int, batch_number: int) -> None:
    """Replaced by _install_faults below when a test asks for a fault."""


def _install() -> None:
    import torch
    import torch.distributed as dist
    import torch.utils.data as data

    record_path = os.path.join(PROBE_DIR, f"{os.getpid()}.jsonl")
    optimizers: list = []

    def record(event: dict) -> None:
        with open(record_path, "a") as out:
            out.write(json.dumps(event) + "\n")

    def current_rank() -> int | None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None

    original_init_pg = dist.init_process_group

    def init_process_group(*args, **kwargs):
        result = original_init_pg(*args, **kwargs)
        record(
            {
                "event": "init",
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "backend": str(dist.get_backend()),
            }
        )
        return result

    dist.init_process_group = init_process_group

    original_destroy = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if dist.is_initialized():
            if optimizers:
                params = [
                    p.detach().cpu().clone()
                    for group in optimizers[0].param_groups
                    for p in group["params"]
                ]
                torch.save(params, os.path.join(PROBE_DIR, f"{os.getpid()}.params.pt"))
            record({"event": "final", "rank": dist.get_rank(), "threads": torch.get_num_threads()})
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group

    original_loader_init = data.DataLoader.__init__
    loader_count = [0]

    def tagging(original_init):
        """An __init__ that tags the loader's batch sampler with the loader's creation order."""

        def loader_init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            if self.batch_sampler is not None:
                self.batch_sampler._probe_loader = loader_count[0]
                self.batch_sampler._probe_pass = 0
            loader_count[0] += 1

        return loader_init

    data.DataLoader.__init__ = tagging(original_loader_init)

    def on_batch(loader, pass_number: int, batch_number: int, batch: list) -> None:
        if loader is None:
            return
        record(
            {
                "event": "batch",
                "loader": loader,
                "pass": pass_number,
                "rank": current_rank(),
                "indices": [int(i) for i in batch],
            }
        )
        inject_fault(loader, pass_number, batch_number)

    original_batch_iter = data.BatchSampler.__iter__

    def batch_iter(self):
        loader = getattr(self, "_probe_loader", None)
        pass_number = getattr(self, "_probe_pass", 0)
        self._probe_pass = pass_number + 1
        for batch_number, batch in enumerate(original_batch_iter(self)):
            on_batch(loader, pass_number, batch_number, batch)
            yield batch

    data.BatchSampler.__iter__ = batch_iter

    original_optimizer_init = torch.optim.Optimizer.__init__

    def optimizer_init(self, params, *args, **kwargs):
        params = list(params)  # may be a generator: materialise it once for both uses
        original_optimizer_init(self, params, *args, **kwargs)
        if not optimizers:  # the first optimizer holds the model being trained
            optimizers.append(self)

    torch.optim.Optimizer.__init__ = optimizer_init

    # torchdata's StatefulDataLoader (step 7) has a batch sampler of its own whose iterator
    # saves its position; a resumed one skips the batches already done without drawing them,
    # so its batch numbers count from the epoch's start.
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader import sampler as stateful
    except ImportError:
        return
    StatefulDataLoader.__init__ = tagging(StatefulDataLoader.__init__)
    original_stateful_iter = stateful.BatchSampler.__iter__

    def stateful_iter(self):
        iterator = original_stateful_iter(self)
        # The pass is the DistributedSampler's epoch: the loader with workers makes more than
        # one iterator per pass.
        pass_number = getattr(self.sampler, "epoch", 0)
        iterator._probe = (getattr(self, "_probe_loader", None), pass_number)
        return iterator

    stateful.BatchSampler.__iter__ = stateful_iter
    original_next = stateful._BatchSamplerIterator.__next__

    def stateful_next(self):
        batch_number = self.samples_yielded // self.batch_size
        batch = original_next(self)
        loader, pass_number = getattr(self, "_probe", (None, 0))
        on_batch(loader, pass_number, batch_number, batch)
        return batch

    stateful._BatchSamplerIterator.__next__ = stateful_next


if PROBE_DIR:
    _install()


# Appended for the Slurm tests (multi-node): which node each rank ran on, and which ranks
# wrote files with torch.save (the probe's own files excluded):
# - {"event": "node", "rank", "node", "local_rank"}  after init_process_group: the node is
#   SLURMD_NODENAME under Slurm, else DDP_PROBE_NODE (a test's name for a launcher it started),
#   else the host name; the local rank is the launcher's (LOCAL_RANK, else SLURM_LOCALID)
# - {"event": "save", "rank", "path"}  at every torch.save
# and, to test that a failing rank ends the whole job: the process whose launcher-given rank
# (RANK, else SLURM_PROCID) equals DDP_PROBE_FAIL_RANK exits with status 3 just before
# init_process_group, as a rank that crashes at start-up would, after recording
# - {"event": "fail", "rank", "time"}
# and, to test that a hang ends within a test's timeout: the process whose rank (the `rank`
# passed to init_process_group, else the launcher's) equals DDP_PROBE_HANG_RANK never reaches
# init_process_group (it sleeps), as a rank stuck before a collective would, after recording
# - {"event": "hang", "rank"}; every other process records {"event": "waiting", "rank"} there
def _install_node_and_save() -> None:
    import socket
    import time

    import torch
    import torch.distributed as dist

    def record(event: dict) -> None:
        with open(os.path.join(PROBE_DIR, f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(event) + "\n")

    wrapped_init_pg = dist.init_process_group

    def init_process_group(*args, **kwargs):
        launcher_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
        if launcher_rank is not None and launcher_rank == os.environ.get("DDP_PROBE_FAIL_RANK"):
            record({"event": "fail", "rank": int(launcher_rank), "time": time.time()})
            os._exit(3)
        hang_rank = os.environ.get("DDP_PROBE_HANG_RANK")
        if hang_rank is not None:
            rank = str(kwargs.get("rank", launcher_rank))
            record({"event": "hang" if rank == hang_rank else "waiting", "rank": int(rank)})
            if rank == hang_rank:
                time.sleep(3600)
        result = wrapped_init_pg(*args, **kwargs)
        node = (
            os.environ.get("SLURMD_NODENAME")
            or os.environ.get("DDP_PROBE_NODE")
            or socket.gethostname()
        )
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", -1)))
        record({"event": "node", "rank": dist.get_rank(), "node": node, "local_rank": local_rank})
        return result

    dist.init_process_group = init_process_group

    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        path = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else repr(f)
        if not path.startswith(os.path.abspath(PROBE_DIR) + os.sep):
            record(
                {
                    "event": "save",
                    "rank": dist.get_rank() if dist.is_initialized() else None,
                    "path": path,
                }
            )
        return original_save(obj, f, *args, **kwargs)

    torch.save = save


if PROBE_DIR:
    _install_node_and_save()


# Appended for the failure tests (tests/test_failures.py): faults injected at a chosen moment.
# DDP_PROBE_KILL_AT / DDP_PROBE_RAISE_AT = "rank:pass:batch" act when that rank's training loader
# (loader 0) draws that batch of that pass: KILL sends SIGKILL to the process itself, only in
# torchrun's first attempt (TORCHELASTIC_RESTART_COUNT, else DDP_PROBE_ATTEMPT, 0 or unset), so a
# restarted worker runs on;
# RAISE raises a RuntimeError. DDP_PROBE_CRASH_AT_REPLACE = N kills the process (SIGKILL) at its
# N-th os.replace call, after the temporary file was written and before it is renamed.
# Each records {"event": "killed" | "raised" | "crashed", "rank", "time"} first.
def _install_faults() -> None:
    import signal
    import time

    import torch.distributed as dist

    def record(event: dict) -> None:
        with open(os.path.join(PROBE_DIR, f"{os.getpid()}.jsonl"), "a") as out:
            out.write(
                json.dumps(
                    dict(
                        event,
                        rank=dist.get_rank() if dist.is_initialized() else None,
                        time=time.time(),
                    )
                )
                + "\n"
            )

    def parse(name: str) -> tuple[int, int, int] | None:
        value = os.environ.get(name)
        return tuple(int(part) for part in value.split(":")) if value else None

    kill_at, raise_at = parse("DDP_PROBE_KILL_AT"), parse("DDP_PROBE_RAISE_AT")
    first_attempt = (
        os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("DDP_PROBE_ATTEMPT", "0"))
        == "0"
    )

    def inject(loader, pass_number: int, batch_number: int) -> None:
        if loader == 0 and dist.is_initialized():
            now = (dist.get_rank(), pass_number, batch_number)
            if now == kill_at and first_attempt:
                record({"event": "killed"})
                os.kill(os.getpid(), signal.SIGKILL)
            if now == raise_at:
                record({"event": "raised"})
                raise RuntimeError(f"probe: rank {now[0]} fails on purpose at batch {batch_number}")

    global inject_fault
    inject_fault = inject

    crash_at, replaces = int(os.environ.get("DDP_PROBE_CRASH_AT_REPLACE", 0)), [0]
    original_replace = os.replace

    def replace(source, destination, *args, **kwargs):
        replaces[0] += 1
        if replaces[0] == crash_at:
            record({"event": "crashed", "source": os.fspath(source)})
            os.kill(os.getpid(), signal.SIGKILL)
        return original_replace(source, destination, *args, **kwargs)

    os.replace = replace


if PROBE_DIR:
    _install_faults()
