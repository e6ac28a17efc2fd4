"""Your own script: what the wrapper and the extra ranks change. See README.md.

Nine things a single-device script does that change meaning under DDP, each
tried on every rank; rank 0 prints one `effect=...` line per thing. Without
--fix each is done the single-device way (an error or a wrong number); with
--fix the DDP way.

    torchrun --standalone --nproc_per_node=2 wrapper.py
    torchrun --standalone --nproc_per_node=2 wrapper.py --fix
"""

import argparse
import os
import pickle
import shutil
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="the DDP way")
    parser.add_argument(
        "--no-accel", action="store_true", help="train on the CPU"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def first_line(error: Exception, containing: str = "") -> str:
    """The line of an error's message that says what went wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    found = [line for line in lines if containing in line]
    return f"{type(error).__name__}: {(found or lines)[0]}"


class Net(nn.Module):
    """A model of the kind a single-device script brings: a method of its
    own, a constant buffer with unusual strides, dropout; BatchNorm if
    asked."""

    def __init__(
        self,
        width: int = 8,
        max_len: int = 16,
        pe: str = "transpose",
        batchnorm: bool = False,
    ):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1) / max_len
        encoding = torch.sin(position * torch.arange(1, width + 1))
        # (max_len, 1, width) by a transpose, as positional encodings often
        # are: the size-1 dimension gets a stride a fresh tensor would not
        # have, which .clone() keeps. unsqueeze(1): the same values, plainly.
        made = {
            "transpose": encoding.unsqueeze(0).transpose(0, 1),
            "clone": encoding.unsqueeze(0).transpose(0, 1).clone(),
            "unsqueeze": encoding.unsqueeze(1),
        }
        self.register_buffer("pe", made[pe])
        self.drop = nn.Dropout(0.5)
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if batchnorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(self.drop(x + self.pe[: x.size(0)]))
        if self.norm is not None:
            out = self.norm(out.flatten(0, 1)).view_as(out)
        return out

    def init_hidden(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.linear.out_features)


def custom_method(model: DDP, fix: bool) -> str:
    # --fix: the wrapper passes on forward() alone; the model's own methods
    # and attributes are on .module
    owner = model.module if fix else model
    try:
        hidden = owner.init_hidden(4)
    except AttributeError as error:
        return "error=" + first_line(error)
    return f"ok shape={tuple(hidden.shape)}"


def save_model(model: DDP, fix: bool, folder: str) -> str:
    if dist.get_rank() != 0:
        return ""
    path = os.path.join(folder, "model.pt")
    if fix:
        # --fix: the bare model's weights, which load into a bare Net
        torch.save(model.module.state_dict(), path)
    else:
        # the whole object: here the wrapper, with the model inside
        torch.save(model, path)
    try:
        # weights_only=True, torch.load's default since PyTorch 2.6
        loaded = torch.load(path)
    except pickle.UnpicklingError as error:
        message = first_line(error, "Unsupported global")
        return "error=" + message.split(" Please use")[0]
    Net().load_state_dict(loaded)
    return "ok loads into a bare Net"


def checkpoint(model: DDP, fix: bool, folder: str) -> str:
    # A checkpoint every N steps, from inside the training loop
    path, state = os.path.join(folder, "step_100.pt"), None
    if fix:
        # --fix: rank 0 alone saves, the bare model's weights
        if dist.get_rank() == 0:
            state = model.module.state_dict()
    else:
        # the single-device habit: every rank, the wrapper's weights
        state = model.state_dict()
    if state is not None:
        torch.save(state, path)
    # How many ranks wrote the one file (each after its own write).
    writers = torch.tensor([state is not None], dtype=torch.int64)
    dist.all_reduce(writers)
    if dist.get_rank() != 0:
        return ""
    try:
        # what the file holds, loaded into the bare model
        Net().load_state_dict(state)
    except RuntimeError as error:
        message = first_line(error, "Missing key")
        return f"writers={writers.item()} error=" + message
    return f"writers={writers.item()} ok loads into a bare Net"


def buffers(model: DDP) -> str:
    # The first forward after the wrap, and every forward after a forward
    # with gradients on: DDP first copies rank 0's buffers to all ranks
    # (forward_sync_buffers=True, the default), writing into each rank's
    # buffer; train() or eval() plays no part.
    try:
        model(torch.randn(5, 3, 8))
    except RuntimeError as error:
        return "error=" + first_line(error)
    return f"ok forward_sync_buffers={model.forward_sync_buffers}"


def buffers_remade(fix: bool) -> str:
    # Another way out, keeping the copy: without --fix the clone() that the
    # message asks for.
    # --fix: the buffer made without the transpose
    model = DDP(Net(pe="unsqueeze" if fix else "clone"))
    return buffers(model)


def buffers_beside() -> str:
    # The same transposed buffer beside BatchNorm's: the copy of the two
    # works (it fails only for that buffer copied alone).
    return buffers(DDP(Net(batchnorm=True)))


def dropout(model: DDP) -> str:
    # The mask a training forward's dropout draws on this rank
    mask = model.module.drop(torch.ones(64)) != 0
    masks = [torch.empty_like(mask) for _ in range(dist.get_world_size())]
    dist.all_gather(masks, mask)
    same = all(torch.equal(m, masks[0]) for m in masks)
    return f"same_mask_on_every_rank={same}"


def device_choice(fix: bool, no_accel: bool) -> str:
    if fix:
        # --fix: an accelerator only if one is usable and wanted; the backend
        # (and set_device, on an accelerator) follow from the device chosen
        use_accel = torch.accelerator.is_available() and not no_accel
        accelerator = torch.accelerator.current_accelerator()
        device = accelerator if use_accel else torch.device("cpu")
    else:
        # the accelerator torch was built for, whether this machine has one
        device = torch.accelerator.current_accelerator() or torch.device("cpu")
    backend = dist.get_default_backend_for_device(device)
    try:
        torch.zeros(1, device=device)
    except RuntimeError as error:
        return f"device={device} backend={backend} error=" + first_line(error)
    return f"device={device} backend={backend} ok"


def forward_device(fix: bool) -> str:
    # The input on a GPU; the meta device (shapes without data) stands in
    # for it here: this machine has none
    x = torch.ones(4, 8, device="meta")
    # the single-device habit inside forward: no device, so the CPU
    device = None
    if fix:
        # --fix: a tensor made inside forward goes to the input's device
        device = x.device
    mask = torch.ones(4, 1, device=device)
    try:
        x * mask
    except RuntimeError as error:
        return f"made_on={mask.device} error=" + first_line(error)
    return f"ok made_on={mask.device}"


def full_batch(fix: bool, rank: int, world_size: int) -> str:
    # 12 samples in batches of 4: three full batches on one device. On 2
    # ranks each shard holds 6 of them: a batch of 4, then one of 2.
    batch_size = 4
    data = TensorDataset(torch.arange(12 * 9.0).view(12, 3, 3))
    sampler = DistributedSampler(data, world_size, rank, shuffle=False)
    rows = []
    for (x,) in DataLoader(data, batch_size=batch_size, sampler=sampler):
        # --fix: the rows this batch has, not the configured batch size (a
        # single-device script's x.view(args.batch_size, -1))
        first = x.size(0) if fix else batch_size
        try:
            flat = x.view(first, -1)
        except RuntimeError as error:
            return "error=" + first_line(error)
        rows.append(flat.size(0))
    return f"ok rows={rows}"


def len_dataset(fix: bool) -> list[str]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = TensorDataset(torch.arange(10))
    # two ways to give each rank its share of an evaluation set
    sampler = DistributedSampler(data, shuffle=False)
    loaders = {
        "DistributedSampler": DataLoader(data, batch_size=4, sampler=sampler),
        "Subset": DataLoader(Subset(data, range(rank, 10, world_size)), 4),
    }
    lines = []
    for name, loader in loaders.items():
        # a model that is always right: the true accuracy is 100%
        correct = sum(len(batch) for (batch,) in loader)
        totals = torch.tensor([correct, correct])
        local = totals.clone()
        dist.all_reduce(totals)
        if fix:
            # --fix: divide by the samples scored, counted like the hits
            local_acc, global_acc = local[0] / local[1], totals[0] / totals[1]
        else:
            # the single-device habit: divide by the data set's length
            seen = len(loader.dataset)
            local_acc, global_acc = local[0] / seen, totals[0] / seen
        lines.append(
            f"loader={name} len_dataset={len(loader.dataset)}"
            f" local_acc={100 * local_acc:.1f}%"
            f" global_acc={100 * global_acc:.1f}%"
        )
    return lines


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    # The single-device script's one seed, on every rank: the same weights.
    torch.manual_seed(args.seed)
    net = Net()
    if args.fix:
        # --fix: the buffer is a constant, so there is nothing to copy before
        # each forward (forward_sync_buffers: torch 2.13 deprecated its older
        # name, broadcast_buffers, which prints a FutureWarning)
        model = DDP(net, forward_sync_buffers=False)
        # --fix: then a seed per rank, for the random draws of training
        torch.manual_seed(args.seed + rank)
    else:
        model = DDP(net)
    # One folder for every rank: rank 0's, its name broadcast.
    folders = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folders, src=0)
    folder = folders[0]

    lines = [f"custom_method {custom_method(model, args.fix)}"]
    lines.append(f"save_model {save_model(model, args.fix, folder)}")
    lines.append(f"buffers {buffers(model)}")
    lines.append(f"buffers_remade {buffers_remade(args.fix)}")
    lines.append(f"buffers_beside {buffers_beside()}")
    lines.append(f"dropout {dropout(model)}")
    lines.append(f"checkpoint {checkpoint(model, args.fix, folder)}")
    lines.append(f"device {device_choice(args.fix, args.no_accel)}")
    lines.append(f"forward_device {forward_device(args.fix)}")
    full = full_batch(args.fix, rank, dist.get_world_size())
    lines.append(f"full_batch {full}")
    lines += [f"len_dataset {line}" for line in len_dataset(args.fix)]
    if rank == 0:
        shutil.rmtree(folder)
        for line in lines:
            log(f"effect={line}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
