"""Your own script: a language model on a token stream. See README.md.

An LSTM language model with tied weights, trained on a stream of tokens cut
into BPTT windows, with its hidden state carried from window to window. A
stream has no Dataset to hand to a DistributedSampler. Without --fix each
rank takes every world_size-th token (the sampler's habit) and reports its
own validation loss. With --fix each rank takes a block of the batchified
stream's columns, and the validation loss is summed over all ranks.

    torchrun --standalone --nproc_per_node=2 token_stream.py
    torchrun --standalone --nproc_per_node=2 token_stream.py --fix
"""

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="column blocks, global val loss"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--batch-size", type=int, default=16, help="columns, all ranks"
    )
    parser.add_argument(
        "--eval-columns", type=int, default=8, help="columns, all ranks"
    )
    parser.add_argument("--bptt", type=int, default=16, help="window length")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def make_stream(length: int, generator: torch.Generator) -> torch.Tensor:
    """Tokens where each one mostly follows from the one before it: 80% of
    the time the successor a fixed permutation gives, else any token."""
    # The same rule for every stream: a permutation drawn from a fixed seed.
    rule = torch.Generator().manual_seed(0)
    successor = torch.randperm(VOCAB, generator=rule).tolist()
    noise = torch.randint(VOCAB, (length,), generator=generator).tolist()
    keep = (torch.rand(length, generator=generator) < 0.8).tolist()
    tokens = [0]
    for t in range(1, length):
        tokens.append(successor[tokens[-1]] if keep[t] else noise[t])
    return torch.tensor(tokens)


def batchify(stream: torch.Tensor, columns: int) -> torch.Tensor:
    """(rows, columns): column j is the j-th contiguous piece of the stream,
    so row i + 1 continues row i in every column."""
    rows = len(stream) // columns
    return stream[: rows * columns].view(columns, rows).t().contiguous()


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple:
    """A window of rows and, flattened, the tokens that follow each one."""
    n = min(bptt, len(source) - 1 - i)
    return source[i : i + n], source[i + 1 : i + 1 + n].view(-1)


class TinyLM(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width)
        self.out = nn.Linear(width, VOCAB)
        # Weight tying: the output layer reuses the embedding's matrix.
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor, hidden: tuple) -> tuple:
        y, hidden = self.lstm(self.embed(x), hidden)
        return self.out(y), hidden

    def init_hidden(self, columns: int) -> tuple:
        width = self.lstm.hidden_size
        zeros = self.out.weight.new_zeros(1, columns, width)
        return zeros, zeros.clone()


def shard(stream: torch.Tensor, columns: int, fix: bool) -> torch.Tensor:
    """This rank's part of the stream, batchified."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not fix:
        # The DistributedSampler habit: every world_size-th token. Each
        # column now jumps over the other ranks' tokens: no stream is left.
        return batchify(stream[rank::world_size], columns // world_size)
    # --fix: batchify the whole stream once, then a block of its columns
    # each: whole streams, and every rank the same rows, so the same steps.
    per_rank = columns // world_size
    mine = batchify(stream, columns)[
        :, rank * per_rank : (rank + 1) * per_rank
    ]
    # A column slice is a view with the whole tensor's strides: copy it, or
    # get_batch's .view(-1) fails ("view size is not compatible").
    return mine.contiguous()


@torch.no_grad()
def loss_sums(model: nn.Module, data: torch.Tensor, bptt: int):
    """(summed token loss, tokens) over the data; a hidden state per column."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    hidden = model.init_hidden(data.size(1))
    for i in range(0, len(data) - 1, bptt):
        x, y = get_batch(data, i, bptt)
        logits, hidden = model(x, hidden)
        sums[0] += F.cross_entropy(logits.view(-1, VOCAB), y, reduction="sum")
        sums[1] += len(y)
    return sums


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for name in ("batch_size", "eval_columns"):
        if getattr(args, name) % world_size:
            flag = "--" + name.replace("_", "-")
            sys.exit(
                f"error: {flag} must split evenly into {world_size} ranks"
            )
    # The same stream on every rank; each takes its part below.
    g = torch.Generator().manual_seed(args.seed)
    train_stream, val_stream = make_stream(16384, g), make_stream(4096, g)
    train = shard(train_stream, args.batch_size, args.fix)
    val = shard(val_stream, args.eval_columns, args.fix)
    steps = len(range(0, len(train) - 1, args.bptt))
    log(f"rank {rank} columns={train.size(1)} rows={len(train)} steps={steps}")

    torch.manual_seed(args.seed)
    model = DDP(TinyLM())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(1, args.epochs + 1):
        model.train()
        # A hidden state per rank, as wide as its own shard: init_hidden is
        # the model's own method, so it is reached through .module.
        hidden = model.module.init_hidden(train.size(1))
        for i in range(0, len(train) - 1, args.bptt):
            x, y = get_batch(train, i, args.bptt)
            # Carry the state, not the graph: backward stops at this window.
            hidden = tuple(h.detach() for h in hidden)
            logits, hidden = model(x, hidden)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        # Evaluate the bare model: DDP's forward is for training steps.
        sums = loss_sums(model.module, val, args.bptt)
        if args.fix:
            # --fix: every token's loss counted once, over all ranks
            dist.all_reduce(sums)
        log(f"epoch {epoch} rank {rank} val_loss={sums[0] / sums[1]:.6f}")
        if rank == 0:
            # For comparison: one process scores the whole stream, unsplit.
            whole = loss_sums(
                model.module,
                batchify(val_stream, args.eval_columns),
                args.bptt,
            )
            log(
                f"epoch {epoch} one_process_val_loss={whole[0] / whole[1]:.6f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
