"""Your own script: what the wrapper and the extra ranks change. See README.md.

Seven things a single-device script does that change meaning under DDP, each
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
    own, a constant buffer with unusual strides, dropout."""

    def __init__(
        self, width: int = 8, max_len: int = 16, pe: str = "transpose"
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.drop(x + self.pe[: x.size(0)]))

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


def buffers(model: DDP) -> str:
    # A forward in train mode: DDP first copies rank 0's buffers to all
    # ranks (forward_sync_buffers=True, the default), writing into each
    # rank's buffer.
    try:
        model(torch.randn(5, 3, 8))
    except RuntimeError as error:
        return "error=" + first_line(error)
    return f"ok forward_sync_buffers={model.forward_sync_buffers}"


def buffers_remade(fix: bool) -> str:
    # Another way out, for a model whose other buffers must be broadcast
    # (BatchNorm's statistics): without --fix the clone() that the message
    # asks for.
    # --fix: the buffer made without the transpose
    model = DDP(Net(pe="unsqueeze" if fix else "clone"))
    return buffers(model)


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
    folder = tempfile.mkdtemp() if rank == 0 else ""

    lines = [f"custom_method {custom_method(model, args.fix)}"]
    lines.append(f"save_model {save_model(model, args.fix, folder)}")
    lines.append(f"buffers {buffers(model)}")
    lines.append(f"buffers_remade {buffers_remade(args.fix)}")
    lines.append(f"dropout {dropout(model)}")
    lines.append(f"device {device_choice(args.fix, args.no_accel)}")
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
