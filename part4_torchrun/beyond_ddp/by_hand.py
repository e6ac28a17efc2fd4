"""Beyond DDP: step 3's wrapper and step 4's optimizer, made drop-ins.

    from by_hand import ByHandDDP, ZeRO1

    model = ByHandDDP(model)  # in DDP(model)'s place
    optimizer = ZeRO1(model.parameters(), torch.optim.SGD, lr=0.1)

Steps 3 and 4 show how; this module adds what a training loop written for
DDP and a torch.optim optimizer asks of them: nothing to call after
backward(), several backward() calls per step, no_sync(), keyword arguments;
param_groups that schedulers change, add_param_group(), step(closure), and
the whole state on one rank (consolidate_state_dict, then state_dict) that
load_state_dict() takes back. step8_drop_in.py trains part 4's model with
them; tests/test_beyond_ddp.py checks each against DistributedDataParallel
and ZeroRedundancyOptimizer.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable


class ByHandDDP(nn.Module):
    """Step 3's wrapper: buckets sent from gradient hooks in backward()."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25):
        super().__init__()
        self.module = module
        # step 1: every rank starts from rank 0's parameters and buffers
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sync_buffers = True
        # step 2: buckets filled from the last parameter: backward()'s order
        self.buckets = [[]]
        for param in reversed(self.params):
            size = sum(p.nbytes for p in self.buckets[-1]) + param.nbytes
            if self.buckets[-1] and size > bucket_mb * 2**20:
                self.buckets.append([])
            self.buckets[-1].append(param)
        # step 3: autograd calls grad_ready(param) once param.grad is in
        self.ready, self.sent = set(), []
        hook = torch.Tensor.register_post_accumulate_grad_hook
        self.hooks = [hook(p, self.grad_ready) for p in self.params]
        # drop-in: no_sync() clears it; each forward reads it, as DDP's
        self.require_sync = self.syncing = True

    def forward(self, *inputs, **kwargs):
        # step 1: rank 0's buffers copied to all, DDP's rule
        if self.sync_buffers:
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)
        self.sync_buffers = torch.is_grad_enabled()
        # drop-in: the backward() of this forward sends, or only adds up
        self.syncing = self.require_sync
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        # drop-in: backward() of a forward run in here only adds its
        # gradients to .grad on each rank; the next one outside sends sums
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def grad_ready(self, param: torch.Tensor) -> None:
        if not self.syncing:
            return
        if not self.ready:
            # drop-in: the first gradient of this backward(): autograd
            # calls average_gradients() when it ends, as it calls DDP's
            Variable._execution_engine.queue_callback(self.average_gradients)
        self.ready.add(param)
        # step 3: the buckets leave in their order, each once it is full
        while len(self.sent) < len(self.buckets):
            params = self.buckets[len(self.sent)]
            if not self.ready.issuperset(params):
                break
            flat = torch.cat([p.grad.flatten() for p in params])
            work = dist.all_reduce(flat, async_op=True)
            self.sent.append((params, flat, work))

    def average_gradients(self) -> None:
        # drop-in: called at the end of backward(); a call after it (a
        # loop written for step 3) finds nothing left to do
        if not self.ready:
            return
        for param in self.params:
            if param not in self.ready:
                # drop-in: no gradient from this backward(): zeros, or
                # what no_sync()'s backward() calls added up, as DDP sends
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self.grad_ready(param)
        # step 3: wait for each bucket's sum; the means go into .grad
        for params, flat, work in self.sent:
            work.wait()
            flat /= dist.get_world_size()
            means = flat.split([p.numel() for p in params])
            for param, mean in zip(params, means, strict=True):
                param.grad.copy_(mean.view_as(param))
        self.ready, self.sent = set(), []


class ZeRO1(torch.optim.Optimizer):
    """Step 4's optimizer: each rank steps and keeps its own parameters'."""

    def __init__(self, params, optimizer_class: type, **settings):
        self.owner, self.owned = {}, [0] * dist.get_world_size()
        self.whole = None
        # drop-in: the base class makes the groups (a list of tensors, or
        # of dicts: groups with settings of their own) by add_param_group
        super().__init__(params, settings)
        mine = [self.mine(group) for group in self.param_groups]
        self.optimizer = optimizer_class(mine, **settings)

    def mine(self, group: dict) -> dict:
        # a group's settings, with this rank's parameters only (maybe none)
        rank = dist.get_rank()
        return {
            **group,
            "params": [p for p in group["params"] if self.owner[p] == rank],
        }

    def add_param_group(self, group: dict) -> None:
        super().add_param_group(group)
        # step 4: whole parameters dealt out to the ranks, the largest
        # first, each to the rank that owns the fewest elements so far
        params = self.param_groups[-1]["params"]
        for param in sorted(params, key=torch.numel, reverse=True):
            self.owner[param] = self.owned.index(min(self.owned))
            self.owned[self.owner[param]] += param.numel()
        # drop-in: a group added later (a layer unfrozen) joins it too
        if hasattr(self, "optimizer"):
            self.optimizer.add_param_group(self.mine(self.param_groups[-1]))

    def step(self, closure=None):
        # drop-in: what a scheduler or the loop wrote in param_groups (lr,
        # weight_decay...) reaches the optimizer that steps
        pairs = zip(
            self.param_groups, self.optimizer.param_groups, strict=True
        )
        for group, inner in pairs:
            inner.update({k: v for k, v in group.items() if k != "params"})
        # drop-in: the inner optimizer calls the closure, on every rank
        loss = self.optimizer.step(closure)
        # step 4: each parameter's owner sends its new weights to all
        for param, owner in self.owner.items():
            dist.broadcast(param.detach(), src=owner)
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        # drop-in: every rank sends its parameters' state (on the CPU),
        # numbered by their place in the groups as torch.optim numbers
        # them; rank `to` keeps the whole, for state_dict(); every rank
        # calls it, as ZeroRedundancyOptimizer's
        params = [p for group in self.param_groups for p in group["params"]]
        place = {param: i for i, param in enumerate(params)}
        mine = {
            place[param]: {
                k: v.cpu() if torch.is_tensor(v) else v
                for k, v in state.items()
            }
            for param, state in self.optimizer.state.items()
        }
        shards = [None] * dist.get_world_size()
        gather = shards if dist.get_rank() == to else None
        dist.gather_object(mine, gather, dst=to)
        if dist.get_rank() == to:
            self.whole = {i: s for shard in shards for i, s in shard.items()}

    def state_dict(self) -> dict:
        # drop-in: the whole state, as one torch.optim optimizer of every
        # parameter would give it: the inner optimizer's settings in each
        # group, the parameters numbered in order
        if self.whole is None:
            rank = dist.get_rank()
            raise RuntimeError(
                f"ZeRO1: call consolidate_state_dict(to={rank}) on every"
                " rank before state_dict() on this one"
            )
        groups, count = [], 0
        pairs = zip(
            self.param_groups, self.optimizer.param_groups, strict=True
        )
        for group, inner in pairs:
            numbers = list(range(count, count + len(group["params"])))
            groups.append({**inner, **group, "params": numbers})
            count += len(numbers)
        return {
            "state": dict(sorted(self.whole.items())),
            "param_groups": groups,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        # drop-in: a whole state (this class's, or any torch.optim
        # optimizer's of the same parameters) read by the base class, each
        # tensor to its parameter's device; each rank hands its optimizer
        # its own parameters' state and drops the rest
        super().load_state_dict(state_dict)
        for param, owner in self.owner.items():
            state = self.state.pop(param, None)
            if state is not None and owner == dist.get_rank():
                self.optimizer.state[param] = state
