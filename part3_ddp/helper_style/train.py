"""The helper-module style: a short training file; ddp_helpers.py does the
distributed parts.

Compare with part3_ddp/step5_checkpoint.py, where every distributed line is
visible in the training script. Here the training loop reads like
single-process code; the price is that the distributed behaviour lives in
another file.

    python part3_ddp/helper_style/train.py --nprocs 1
    python part3_ddp/helper_style/train.py --nprocs 2
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# Found next to this file: python puts the script's folder on sys.path.
import ddp_helpers as ddp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    nprocs = torch.cuda.device_count() or 2
    parser.add_argument(
        "--nprocs", type=int, default=nprocs, help="processes (ranks)"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="per process"
    )
    parser.add_argument("--data-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def dummy_dataset(size: int, seed: int) -> TensorDataset:
    """4 classes, told apart by which quarter of [0, 4) a single number falls
    in."""
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.rand(size, 1, generator=g)
    return TensorDataset(x, x[:, 0].long().clamp(max=3))


def train_one_epoch(model, loader, optimizer) -> torch.Tensor:
    """(summed loss, correct, samples) on this rank, summed on the device: no
    sync per step."""
    model.train()
    device = ddp.get_device()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach() * len(y)
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    return totals


def main_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    if world_size > 1:
        ddp.setup_process_group(rank, world_size)
    # The same initial weights everywhere.
    torch.manual_seed(args.seed)
    for name, value in vars(args).items():
        ddp.print_primary(f"arg {name}={value}")

    dataset = dummy_dataset(args.data_size, args.seed)
    sampler = ddp.data_sampler(dataset, shuffle=True)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
    )
    model = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 4)).to(
        ddp.get_device()
    )
    model = ddp.prepare_ddp_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddp.print_primary(
        f"world_size={ddp.get_world_size()} device={ddp.get_device()}"
        f" wrapped={type(model).__name__}"
    )

    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        totals = train_one_epoch(model, loader, optimizer)
        # Over all ranks; .tolist() waits for the device.
        loss_sum, correct, seen = ddp.reduce(totals, average=False).tolist()
        ddp.print_primary(
            f"epoch {epoch + 1}/{args.epochs} loss={loss_sum / seen:.4f}"
            f" acc={100 * correct / seen:.2f}% samples={int(seen)}"
        )
    ddp.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    ddp.launch(main_worker, args.nprocs, args)
