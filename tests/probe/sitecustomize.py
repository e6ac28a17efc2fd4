"""Test probe: records what each process of a real training run does. Not part of the course.

The tests put this folder on PYTHONPATH and set DDP_PROBE_DIR. Python imports `sitecustomize`
at start-up in every process (mp.spawn children, torchrun workers, srun tasks), so the teaching
scripts run unmodified under their real launchers. The hooks go in when the process imports
torch, so processes that never do (multiprocessing's resource tracker, helpers of the launchers)
start as fast as without the probe. Each process appends one JSON line per event
to DDP_PROBE_DIR/<pid>.jsonl; every line has "event", "rank" (the process group's, else None)
and "time". The events:

- init        {world_size, backend, timeout_s}  after init_process_group; timeout_s: the
              timeout it was given (None: PyTorch's default)
- node        {node, local_rank}     after init_process_group: the node is SLURMD_NODENAME under
              Slurm, else DDP_PROBE_NODE (a test's name for a launcher it started), else the host
              name; the local rank is the launcher's (LOCAL_RANK, else SLURM_LOCALID)
- batch       {loader, workers, start, pass, indices, samples[, sampler]}  every batch a loader's
              batch sampler hands out: loader = the loader's creation order in this process,
              workers = its num_workers (loader processes), start = how they are started (the
              multiprocessing start method: fork, forkserver, spawn; None without workers),
              pass = how many times it was iterated before (for torchdata's
              StatefulDataLoader: its sampler's epoch), indices = what the sampler drew,
              samples = those indices in the underlying data set (through any Subset); the
              first batch of a pass adds sampler = the sampler's class and settings (epoch,
              seed, shuffle, num_replicas, rank, drop_last: those it has)
- collective  {name, file, line}     when the script calls a torch.distributed collective
              (recorded before the call, so a call that never returns is recorded too)
- save        {path}                 every torch.save to a file, the probe's own files excluded
              (not into memory: pickling a tensor, as all_gather_object does, saves into a
              buffer)
- load        {path}                 every torch.load, recorded before the read (so a read of
              a file that is not there yet is recorded too)
- final       {threads}              at destroy_process_group; the parameters of the first
              optimizer (the model being trained) go to <pid>.params.pt
- exit        {gloo_threads}         when Python shuts down normally (atexit; not in children
              that end with os._exit, as fork's do), in a process that called
              init_process_group: how many of gloo's threads still run. 0 when the group was
              released; more when something still holds it and it will be torn down during
              interpreter shutdown, where gloo can abort the process.
- exception   {type, message, launcher_rank, frames}  an exception that ends the process
              (sys.excepthook): frames = [file, line, function] of its traceback, innermost
              last; launcher_rank = RANK, else SLURM_PROCID (the rank before any group exists)
- first_step  {samples}              with DDP_PROBE_FIRST_STEP=1, at the first optimizer's
              first step: what one step computed goes to <pid>.first_step.pt (see
              record_first_step)

With DDP_PROBE_STEPS=1 (the exercise autograder's), what training computed, step by step. A
"forward" is a call of a module with parameters from outside any module (the model's call, not
its layers'); "in train mode" means that module and all its submodules are:

- step        {optimizer, backwards, forwards, train, samples, model, leftover, params,
              graded, nonzero, left, losses, changed, lr, pass}
              after every optimizer step: optimizer = its number in the order the optimizers
              were built (0: the first, whose parameters go to <pid>.params.pt); backwards =
              backward() calls since this optimizer's previous step; forwards = forwards with
              gradients on since then; train = whether the forward before each of those
              backward() calls was in train mode (None without any); samples = the size (dim 0)
              of each of those forwards' input; model = [class, parameters that require grad,
              how many of them the optimizer holds] of the module of the last of those forwards
              (None without any); leftover = how many of that module's parameters held a
              non-zero gradient when the first backward() since the previous step (of any
              optimizer) began: gradients no zero_grad() cleared (None without a backward());
              params = the parameters the optimizer holds, graded = how many had a gradient,
              nonzero = how many a non-zero one; left = how many non-zero gradients the last
              backward() left in that module (None without a backward()): more than nonzero
              when something erased them before the step; losses = [loader, pass, sum of
              loss x samples, samples] of the F.cross_entropy calls (mean reduction, gradients
              on) since the previous step, by the batch's loader and pass (an event "losses"
              at exit holds those no step followed); changed = how many the step changed (on
              the optimizer's first step only, else None); lr = its first parameter group's
              learning rate; pass = [loader, pass] of the last batch a loader handed out (see
              batch; None before any)
- forward     {loader, pass, train, grad, samples}  the first forward after a loader hands
              out a batch of a new pass (or of another loader): which loader and pass it
              follows, whether it ran in train mode and with gradients on, its input's size
- wrap        {module, init_sync}    a DistributedDataParallel is made: the class it wraps,
              and its init_sync (False: rank 0's weights are not copied to the other ranks)

Faults, injected when a test asks for them:

- DDP_PROBE_FAIL_RANK = R: the process whose launcher-given rank (RANK, else SLURM_PROCID) is R
  exits with status 3 just before init_process_group, as a rank that crashes at start-up would,
  after recording `fail`.
- DDP_PROBE_HANG_RANK = R: the process whose rank (init_process_group's `rank`, else the
  launcher's) is R never reaches init_process_group (it sleeps), as a rank stuck before a
  collective would; it records `hang`, every other process records `waiting` there.
- DDP_PROBE_KILL_AT / DDP_PROBE_RAISE_AT / DDP_PROBE_PAUSE_AT = "rank:pass:batch": when that
  rank's training loader (loader 0) hands out that batch of that pass, KILL sends SIGKILL to the
  process itself, only in the first attempt (TORCHELASTIC_RESTART_COUNT, else
  DDP_PROBE_ATTEMPT, 0 or unset, and SLURM_RESTART_COUNT, a requeued job's, 0 or unset), so a
  restarted worker runs on; RAISE raises a RuntimeError; PAUSE, in the first attempt only,
  sleeps there (until something ends the process), so that a test can interrupt a run at a
  known step. They record `killed` / `raised` / `paused` first.
- DDP_PROBE_CRASH_AT_REPLACE = N: SIGKILL at the process's N-th os.replace call, after the
  temporary file was written and before it is renamed; records `crashed` {source} first.
- DDP_PROBE_SAVE_DELAY_S = S: every torch.save to a file waits S seconds before it writes, as a
  slow disk would: a read that is not ordered after the write then loses the race every time.
"""

import atexit
import importlib.abc
import importlib.util
import json
import os
import signal
import socket
import sys
import time
import traceback
import weakref

PROBE_DIR = os.environ.get("DDP_PROBE_DIR")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "reduce")
# The sampler settings a batch record names (DistributedSampler's; others have fewer).
SAMPLER_SETTINGS = ("epoch", "seed", "shuffle", "num_replicas", "rank", "drop_last")

# The first optimizer the process builds: the one that trains the model.
optimizers: list = []
# How many optimizers were built (each is numbered in creation order: its _probe_number).
optimizer_count = [0]
# [loader, pass] of the last batch a loader's batch sampler handed out (record_batches).
current_pass: list = [None]
# torch.save as it was before the probe, for the probe's own files.
original_save = None


def record(event: str, **fields) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    fields = {"rank": rank, **fields}
    line = json.dumps({"event": event, "time": time.time(), **fields})
    with open(os.path.join(PROBE_DIR, f"{os.getpid()}.jsonl"), "a") as out:
        out.write(line + "\n")


def probe_file(suffix: str) -> str:
    return os.path.join(PROBE_DIR, f"{os.getpid()}.{suffix}")


def launcher_rank() -> str | None:
    """The rank the launcher gave this process: torchrun's RANK, else srun's SLURM_PROCID."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID"))


def gloo_threads() -> int | None:
    """This process's threads whose name says gloo (Linux only: None elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read())
        except OSError:
            # The thread ended while we looked.
            pass
    return sum("gloo" in name for name in names)


def fault_at(name: str) -> tuple[int, int, int] | None:
    value = os.environ.get(name)
    return tuple(int(part) for part in value.split(":")) if value else None


def subset_maps(dataset) -> list:
    """The index lists of the Subsets around a loader's data set, outermost first."""
    from torch.utils.data import Subset

    maps = []
    while isinstance(dataset, Subset):
        maps.append(dataset.indices)
        dataset = dataset.dataset
    return maps


def in_dataset(index, maps: list) -> int:
    for indices in maps:
        index = indices[index]
    return int(index)


def start_method(loader, workers: int) -> str | None:
    """How the loader's worker processes start: its multiprocessing_context's method (read at
    each batch, as a script may set it after building the loader), else multiprocessing's
    default."""
    if not workers:
        return None
    import multiprocessing

    context = getattr(loader, "multiprocessing_context", None)
    if context is not None:
        return context.get_start_method()
    # (asked without fixing it: the first method listed is the default)
    return (
        multiprocessing.get_start_method(allow_none=True)
        or (multiprocessing.get_all_start_methods()[0])
    )


def sampler_settings(sampler) -> dict:
    """The sampler's class and the settings it has among SAMPLER_SETTINGS."""
    settings = {"type": type(sampler).__name__}
    for name in SAMPLER_SETTINGS:
        value = getattr(sampler, name, None)
        if isinstance(value, (bool, int)):
            settings[name] = value
    return settings


# ---- what the probe records: one function per kind of event, each wrapping torch's own ----


def record_process_group() -> None:
    """init and node after init_process_group, exit at shutdown; the fail and hang faults."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        launcher = launcher_rank()
        if launcher is not None and launcher == os.environ.get("DDP_PROBE_FAIL_RANK"):
            record("fail", rank=int(launcher))
            os._exit(3)
        hang_rank = os.environ.get("DDP_PROBE_HANG_RANK")
        if hang_rank is not None:
            rank = str(kwargs.get("rank", launcher))
            record("hang" if rank == hang_rank else "waiting", rank=int(rank))
            if rank == hang_rank:
                time.sleep(3600)
        result = original(*args, **kwargs)
        timeout = kwargs.get("timeout")
        record(
            "init",
            world_size=dist.get_world_size(),
            backend=str(dist.get_backend()),
            timeout_s=timeout.total_seconds() if timeout else None,
        )
        node = (
            os.environ.get("SLURMD_NODENAME")
            or os.environ.get("DDP_PROBE_NODE")
            or socket.gethostname()
        )
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", -1)))
        record("node", node=node, local_rank=local_rank)
        rank = dist.get_rank()
        atexit.register(lambda: record("exit", rank=rank, gloo_threads=gloo_threads()))
        return result

    dist.init_process_group = init_process_group


def record_destroy() -> None:
    """final at destroy_process_group, with the trained parameters in <pid>.params.pt."""
    import torch
    import torch.distributed as dist

    original = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if dist.is_initialized():
            if optimizers:
                params = [
                    p.detach().cpu().clone()
                    for group in optimizers[0].param_groups
                    for p in group["params"]
                ]
                original_save(params, probe_file("params.pt"))
            record("final", threads=torch.get_num_threads())
        return original(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group


def record_collectives() -> None:
    """collective, with the caller's file and line, before each call of COLLECTIVES."""
    import torch.distributed as dist

    def recording(name: str, original):
        def collective(*args, **kwargs):
            caller = sys._getframe(1)
            record("collective", name=name, file=caller.f_code.co_filename, line=caller.f_lineno)
            return original(*args, **kwargs)

        return collective

    for name in COLLECTIVES:
        setattr(dist, name, recording(name, getattr(dist, name)))


def record_checkpoint_files() -> None:
    """save and load around torch.save and torch.load; the save-delay fault."""
    import torch

    global original_save
    original_save = torch.save
    original_load = torch.load
    delay = float(os.environ.get("DDP_PROBE_SAVE_DELAY_S", 0))

    def where(f) -> str:
        return os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else repr(f)

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            record("save", path=where(f))
            time.sleep(delay)
        return original_save(obj, f, *args, **kwargs)

    def load(f, *args, **kwargs):
        record("load", path=where(f))
        return original_load(f, *args, **kwargs)

    torch.save, torch.load = save, load


def record_batches() -> None:
    """batch, for every batch a DataLoader's batch sampler hands out; the kill and raise
    faults. Each loader tags its batch sampler at creation; the sampler's iteration records."""
    import torch.distributed as dist
    import torch.utils.data as data

    first_attempt = (
        os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("DDP_PROBE_ATTEMPT", "0"))
        == "0"
        and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    )
    kill_at, raise_at = fault_at("DDP_PROBE_KILL_AT"), fault_at("DDP_PROBE_RAISE_AT")
    pause_at = fault_at("DDP_PROBE_PAUSE_AT")

    def on_batch(sampler, pass_number: int, batch_number: int, batch: list) -> None:
        loader = getattr(sampler, "_probe_loader", None)
        if loader is None:
            return
        workers = sampler._probe_workers
        fields = {
            "loader": loader,
            "workers": workers,
            "start": start_method(sampler._probe_owner(), workers),
            "indices": [int(i) for i in batch],
            "samples": [in_dataset(i, sampler._probe_maps) for i in batch],
            "pass": pass_number,
        }
        if batch_number == 0:
            fields["sampler"] = sampler_settings(getattr(sampler, "sampler", None))
        record("batch", **fields)
        current_pass[0] = [loader, pass_number]
        if loader == 0 and dist.is_initialized():
            now = (dist.get_rank(), pass_number, batch_number)
            if now == kill_at and first_attempt:
                record("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            if now == pause_at and first_attempt:
                record("paused")
                time.sleep(3600)
            if now == raise_at:
                record("raised")
                raise RuntimeError(f"probe: rank {now[0]} fails on purpose at batch {batch_number}")

    loader_count = [0]

    def tagging(original_init):
        """A loader __init__ that tags its batch sampler with the loader's creation order."""

        def loader_init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            if self.batch_sampler is not None:
                self.batch_sampler._probe_loader = loader_count[0]
                self.batch_sampler._probe_pass = 0
                self.batch_sampler._probe_maps = subset_maps(self.dataset)
                self.batch_sampler._probe_workers = self.num_workers
                self.batch_sampler._probe_owner = weakref.ref(self)
            loader_count[0] += 1

        return loader_init

    data.DataLoader.__init__ = tagging(data.DataLoader.__init__)
    original_iter = data.BatchSampler.__iter__

    def batch_iter(self):
        pass_number = getattr(self, "_probe_pass", 0)
        self._probe_pass = pass_number + 1
        for batch_number, batch in enumerate(original_iter(self)):
            on_batch(self, pass_number, batch_number, batch)
            yield batch

    data.BatchSampler.__iter__ = batch_iter
    record_stateful_batches(tagging, on_batch)


def record_stateful_batches(tagging, on_batch) -> None:
    """batch for torchdata's StatefulDataLoader (step 7), whose batch sampler has an iterator
    of its own that saves its position; a resumed one skips the batches already done without
    drawing them, so its batch numbers count from the epoch's start."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader import sampler as stateful
    except ImportError:
        return
    StatefulDataLoader.__init__ = tagging(StatefulDataLoader.__init__)
    original_iter = stateful.BatchSampler.__iter__

    def stateful_iter(self):
        iterator = original_iter(self)
        # The pass is the DistributedSampler's epoch: the loader with workers makes more than
        # one iterator per pass.
        iterator._probe = (self, getattr(self.sampler, "epoch", 0))
        return iterator

    stateful.BatchSampler.__iter__ = stateful_iter
    original_next = stateful._BatchSamplerIterator.__next__

    def stateful_next(self):
        batch_number = self.samples_yielded // self.batch_size
        batch = original_next(self)
        sampler, pass_number = getattr(self, "_probe", (None, 0))
        on_batch(sampler, pass_number, batch_number, batch)
        return batch

    stateful._BatchSamplerIterator.__next__ = stateful_next


def record_optimizer() -> None:
    """Keeps the first optimizer built: it holds the model being trained."""
    import torch

    original = torch.optim.Optimizer.__init__

    def optimizer_init(self, params, *args, **kwargs):
        # may be a generator: materialise it once for both uses
        params = list(params)
        original(self, params, *args, **kwargs)
        self._probe_number = optimizer_count[0]
        optimizer_count[0] += 1
        if not optimizers:
            optimizers.append(self)

    torch.optim.Optimizer.__init__ = optimizer_init


def record_first_step() -> None:
    """first_step: at the first optimizer's first step(), what that step is made of goes to
    <pid>.first_step.pt: {params: the weights before the step, grads: the gradients it
    applies, inputs: the model's input at the last forward of a module with parameters,
    called from outside any module, rng: the CPU random state just before that forward (it
    decides dropout), labels: the second tensor of the last batch a DataLoader gave,
    forwards: [{inputs, rng, labels}, as above, at each backward() call before the step] (at
    most 16: more than one when the gradients of several batches were summed)}. With them,
    one process can recompute what the step should have been. The hooks (on every module call)
    go once the step is recorded."""
    import torch
    import torch.nn as nn
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    seen: dict = {"forwards": []}
    depth = [0]
    original_next = _BaseDataLoaderIter.__next__
    original_backward = torch.autograd.backward

    def labels_of(batch):
        labels = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
        return labels.detach().cpu().clone() if torch.is_tensor(labels) else None

    def backward(*args, **kwargs):
        if len(seen["forwards"]) < 16:
            part = {"inputs": seen.get("inputs"), "rng": seen.get("rng")}
            seen["forwards"].append({**part, "labels": labels_of(seen.get("batch"))})
        return original_backward(*args, **kwargs)

    def next_batch(self):
        batch = original_next(self)
        seen["batch"] = batch
        return batch

    def before_forward(module, args):
        tensor = args and torch.is_tensor(args[0])
        if depth[0] == 0 and tensor and any(True for _ in module.parameters()):
            seen["rng"] = torch.get_rng_state()
            seen["inputs"] = args[0].detach().cpu().clone()
        depth[0] += 1

    def after_forward(module, args, output):
        depth[0] -= 1

    def before_step(optimizer, args, kwargs):
        if not optimizers or optimizer is not optimizers[0]:
            return
        for handle in handles:
            handle.remove()
        _BaseDataLoaderIter.__next__ = original_next
        torch.autograd.backward = original_backward
        params = [p for group in optimizer.param_groups for p in group["params"]]
        step = {
            "params": [p.detach().cpu().clone() for p in params],
            "grads": [None if p.grad is None else p.grad.detach().cpu().clone() for p in params],
            "inputs": seen.get("inputs"),
            "rng": seen.get("rng"),
            "labels": labels_of(seen.get("batch")),
            "forwards": seen["forwards"],
        }
        original_save(step, probe_file("first_step.pt"))
        inputs = step["inputs"]
        record("first_step", samples=None if inputs is None else len(inputs))

    _BaseDataLoaderIter.__next__ = next_batch
    torch.autograd.backward = backward
    handles = [
        nn.modules.module.register_module_forward_pre_hook(before_forward),
        nn.modules.module.register_module_forward_hook(after_forward, always_call=True),
        register_optimizer_step_pre_hook(before_step),
    ]


def record_steps() -> None:
    """step after every optimizer step, forward at the first forward of each loader pass, wrap
    at each DistributedDataParallel made (DDP_PROBE_STEPS=1): what training computed. The
    hooks stay for the whole run: a few attribute reads per model call, a record per step."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    depth = [0]
    # the last forward with gradients on: (module, in train mode, input size); the [loader,
    # pass] the last forward record followed; how many forwards and backward() calls so far
    last: dict = {"forward": None, "pass": False}
    counts = {"forwards": 0, "backwards": 0}
    # the forward before each of the last 16 backward() calls
    backwards: list = []
    # backward() calls at the last step of any optimizer; the leftover gradients the first
    # backward() after it found; the nonzero gradients the last backward() left
    stepped = {"backwards": 0, "leftover": None, "left": None}
    # the losses F.cross_entropy computed with gradients on since the last step, by the
    # [loader, pass] they followed: [sum of loss x samples, samples] (what an epoch line's
    # train_loss should average)
    losses: dict = {}

    def before_forward(module, args):
        first = depth[0] == 0 and args and torch.is_tensor(args[0])
        depth[0] += 1
        if not first or not any(True for _ in module.parameters()):
            return
        train = all(m.training for m in module.modules())
        samples = len(args[0]) if args[0].dim() else 1
        grad = torch.is_grad_enabled()
        if grad:
            counts["forwards"] += 1
            last["forward"] = (module, train, samples)
        if current_pass[0] != last["pass"]:
            last["pass"] = current_pass[0]
            loader, number = current_pass[0] or (None, None)
            fields = {"loader": loader, "pass": number, "train": train, "grad": grad}
            record("forward", **fields, samples=samples)

    def after_forward(module, args, output):
        depth[0] -= 1

    original_backward = torch.autograd.backward

    def backward(*args, **kwargs):
        if counts["backwards"] == stepped["backwards"] and last["forward"] is not None:
            grads = [p.grad for p in last["forward"][0].parameters() if p.grad is not None]
            stepped["leftover"] = sum(bool(g.any()) for g in grads)
        counts["backwards"] += 1
        backwards.append(last["forward"])
        del backwards[:-16]
        result = original_backward(*args, **kwargs)
        if last["forward"] is not None:
            grads = [p.grad for p in last["forward"][0].parameters() if p.grad is not None]
            stepped["left"] = sum(bool(g.any()) for g in grads)
        return result

    original_cross_entropy = torch.nn.functional.cross_entropy

    def cross_entropy(input, target, *args, **kwargs):
        loss = original_cross_entropy(input, target, *args, **kwargs)
        mean = kwargs.get("reduction", "mean") == "mean" and not args
        if torch.is_grad_enabled() and mean and loss.dim() == 0 and input.dim() > 0:
            where = losses.setdefault(tuple(current_pass[0] or (None, None)), [0.0, 0])
            where[0] += float(loss.detach()) * len(input)
            where[1] += len(input)
        return loss

    def taken_losses() -> list:
        """[loader, pass, sum of loss x samples, samples] of the losses since the last
        step, and none left."""
        found = [[*where, total, n] for where, (total, n) in losses.items()]
        losses.clear()
        return found

    def held_params(optimizer) -> list:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def before_step(optimizer, args, kwargs):
        params = held_params(optimizer)
        seen = optimizer.__dict__
        if not seen.get("_probe_steps"):
            seen["_probe_before"] = [p.detach().clone() for p in params]
        n = counts["backwards"] - seen.get("_probe_backwards", 0)
        forwards = backwards[len(backwards) - n :] if n else []
        model = None
        if forwards and forwards[-1] is not None:
            ids = {id(p) for p in params}
            trained = [p for p in forwards[-1][0].parameters() if p.requires_grad]
            model = [type(forwards[-1][0]).__name__, len(trained)]
            model.append(sum(id(p) in ids for p in trained))
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        seen["_probe_pending"] = {
            "optimizer": seen.get("_probe_number"),
            "backwards": n,
            "forwards": counts["forwards"] - seen.get("_probe_forwards", 0),
            "train": all(f[1] for f in forwards if f) if forwards else None,
            "samples": [f[2] for f in forwards if f],
            "model": model,
            "leftover": stepped["leftover"] if n else None,
            "params": len(params),
            "graded": sum(p.grad is not None for p in params),
            # nonzero gradients at the step, and those the last backward() left
            "nonzero": sum(p.grad is not None and bool(p.grad.any()) for p in params),
            "left": stepped["left"] if n else None,
            "losses": taken_losses(),
            "changed": None,
            "lr": float(lr) if isinstance(lr, (int, float)) or torch.is_tensor(lr) else None,
            "pass": current_pass[0],
        }

    def after_step(optimizer, args, kwargs):
        seen = optimizer.__dict__
        fields = seen.pop("_probe_pending", None)
        if fields is None:
            return
        before = seen.pop("_probe_before", None)
        if before is not None:
            pairs = zip(before, held_params(optimizer), strict=False)
            fields["changed"] = sum(not torch.equal(a, p.detach()) for a, p in pairs)
        seen["_probe_steps"] = seen.get("_probe_steps", 0) + 1
        seen["_probe_backwards"] = counts["backwards"]
        seen["_probe_forwards"] = counts["forwards"]
        stepped.update(backwards=counts["backwards"], leftover=None)
        record("step", **fields)

    original_init = DistributedDataParallel.__init__

    def ddp_init(self, module, *args, **kwargs):
        original_init(self, module, *args, **kwargs)
        # by name, else 5th after the module (device_ids, output_device, dim, broadcast_buffers)
        init_sync = kwargs.get("init_sync", args[4] if len(args) > 4 else True)
        record("wrap", module=type(module).__name__, init_sync=bool(init_sync))

    DistributedDataParallel.__init__ = ddp_init
    torch.autograd.backward = backward
    torch.nn.functional.cross_entropy = cross_entropy
    # losses after the last step (a batch no step followed)
    atexit.register(lambda: losses and record("losses", losses=taken_losses()))
    nn.modules.module.register_module_forward_pre_hook(before_forward)
    nn.modules.module.register_module_forward_hook(after_forward, always_call=True)
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)


def record_exceptions() -> None:
    """exception, for an exception that ends the process, before Python prints it."""
    original = sys.excepthook

    def excepthook(kind, value, tb):
        try:
            frames = [[f.filename, f.lineno, f.name] for f in traceback.extract_tb(tb)]
            rank = launcher_rank()
            record(
                "exception",
                type=kind.__name__,
                message=str(value),
                launcher_rank=None if rank is None else int(rank),
                frames=frames[-12:],
            )
        finally:
            original(kind, value, tb)

    sys.excepthook = excepthook


def crash_at_replace() -> None:
    """The DDP_PROBE_CRASH_AT_REPLACE fault: crashed, then SIGKILL, at the N-th os.replace."""
    crash_at, replaces = int(os.environ.get("DDP_PROBE_CRASH_AT_REPLACE", 0)), [0]
    original = os.replace

    def replace(source, destination, *args, **kwargs):
        replaces[0] += 1
        if replaces[0] == crash_at:
            record("crashed", source=os.fspath(source))
            os.kill(os.getpid(), signal.SIGKILL)
        return original(source, destination, *args, **kwargs)

    os.replace = replace


def install() -> None:
    record_process_group()
    record_destroy()
    record_collectives()
    record_checkpoint_files()
    record_batches()
    record_optimizer()
    # (before the first step's hooks: those restore what they wrapped, these stay)
    if os.environ.get("DDP_PROBE_STEPS") == "1":
        record_steps()
    if os.environ.get("DDP_PROBE_FIRST_STEP") == "1":
        record_first_step()
    record_exceptions()
    crash_at_replace()


class AfterTorch(importlib.abc.MetaPathFinder):
    """Finds `torch` as Python would, and installs the hooks right after torch's own import."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        import_torch = spec.loader.exec_module

        def exec_module(module) -> None:
            import_torch(module)
            install()

        spec.loader.exec_module = exec_module
        return spec


if PROBE_DIR:
    sys.meta_path.insert(0, AfterTorch())
