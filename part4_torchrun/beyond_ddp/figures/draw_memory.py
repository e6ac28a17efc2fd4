"""Draws the bytes per parameter that each rank keeps between two steps
(weights, gradients, SGD's momentum) under DDP, ZeRO-1 and FSDP2: predicted
beside measured, for part 4's model (test_resnet) on 2 ranks.

    python part4_torchrun/beyond_ddp/figures/draw_memory.py

runs, each under `torchrun --standalone --nproc_per_node=2` with `--dataset
fake --fake-size 128 --model test_resnet --batch-size 16 --epochs 1
--checkpoint ''`: step8_drop_in.py (DDP), step8_drop_in.py --zero1 (ZeRO-1)
and step6_memory.py (FSDP2); then draws the `memory rank=R params_bytes=...
grads_bytes=... optimizer_bytes=...` lines they print. The prediction: 4
bytes per parameter for each fp32 tensor a rank keeps whole, 4 / world_size
for each it shards (ZeRO-1: the momentum; FSDP2: all three). --from FILE
draws a saved output (the three outputs, each after a line `== NAME`);
--out FILE: the PNG.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TINY = "--dataset fake --fake-size 128 --model test_resnet --batch-size 16"
RUNS = {
    "DDP": "step8_drop_in.py",
    "ZeRO-1": "step8_drop_in.py --zero1",
    "FSDP2": "step6_memory.py",
}
# what each strategy shards (the rest every rank keeps whole)
SHARDED = {
    "DDP": set(),
    "ZeRO-1": {"optimizer"},
    "FSDP2": {"params", "grads", "optimizer"},
}
PARTS = [
    ("params", "weights", "#0072B2"),
    ("grads", "gradients", "#E69F00"),
    ("optimizer", "momentum", "#009E73"),
]
MEMORY = re.compile(
    r"^memory rank=(\d+) params_bytes=(\d+) grads_bytes=(\d+)"
    r" optimizer_bytes=(\d+)$",
    re.MULTILINE,
)


def parse(text: str) -> dict:
    """{strategy: {rank: {params, grads, optimizer: bytes per parameter}}},
    the parameters counted from DDP's whole weights (4 bytes each), and the
    prediction for each strategy and rank."""
    sections = re.split(r"^== (.+)$", text, flags=re.MULTILINE)[1:]
    outputs = dict(zip(sections[::2], sections[1::2], strict=True))
    if sorted(outputs) != sorted(RUNS):
        raise ValueError(
            f"expected outputs of {sorted(RUNS)}: {sorted(outputs)}"
        )
    held = {
        name: {
            int(r): [int(b) for b in rest] for r, *rest in MEMORY.findall(out)
        }
        for name, out in outputs.items()
    }
    for name, ranks in held.items():
        if sorted(ranks) != list(range(len(ranks))) or not ranks:
            raise ValueError(f"{name}: memory lines of ranks {sorted(ranks)}")
    params = held["DDP"][0][0] // 4
    measured, predicted = {}, {}
    for name, ranks in held.items():
        world = len(ranks)
        for rank, sizes in ranks.items():
            keys = [key for key, *_ in PARTS]
            measured.setdefault(name, {})[rank] = {
                key: size / params
                for key, size in zip(keys, sizes, strict=True)
            }
            predicted.setdefault(name, {})[rank] = {
                key: 4 / world if key in SHARDED[name] else 4 for key in keys
            }
    return {"params": params, "measured": measured, "predicted": predicted}


def draw(data: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 12})
    fig, axes = plt.subplots(figsize=(9, 4.6))
    ticks, labels, x = [], [], 0.0
    for name in RUNS:
        for rank in sorted(data["measured"][name]):
            for offset, kind in ((-0.2, "predicted"), (0.2, "measured")):
                bottom = 0.0
                for key, _, color in PARTS:
                    value = data[kind][name][rank][key]
                    axes.bar(
                        x + offset,
                        value,
                        width=0.38,
                        bottom=bottom,
                        color=color if kind == "measured" else "white",
                        edgecolor=color,
                        hatch="//" if kind == "predicted" else None,
                        linewidth=1.2,
                    )
                    bottom += value
                if kind == "measured":
                    axes.text(
                        x + offset,
                        bottom + 0.15,
                        f"{bottom:.2f}",
                        ha="center",
                        fontsize=11,
                    )
            ticks.append(x)
            labels.append(f"{name}\nrank {rank}")
            x += 1.0
        x += 0.5
    # direct labels: the parts, beside DDP's first predicted bar
    bottom = 0.0
    for key, part, color in PARTS:
        value = data["predicted"]["DDP"][0][key]
        axes.text(
            -0.45,
            bottom + value / 2,
            part,
            ha="right",
            va="center",
            color=color,
            fontsize=11,
            fontweight="bold",
        )
        bottom += value
    axes.set_xticks(ticks, labels)
    axes.set_xlim(-1.6, x - 1.0)
    axes.set_ylim(0, 14)
    axes.set_ylabel("bytes per parameter, on one rank")
    axes.set_title(
        f"test_resnet ({data['params']:,} parameters), SGD with momentum,"
        " 2 ranks",
        loc="left",
        fontsize=12,
    )
    axes.text(
        x - 1.0,
        13.2,
        "left, hatched: predicted; right, solid: measured",
        ha="right",
        fontsize=11,
    )
    axes.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def run_all() -> str:
    """The three runs, each output after its `== NAME` line."""
    text = []
    with tempfile.TemporaryDirectory() as folder:
        for name, script in RUNS.items():
            script, *flags = script.split()
            command = [sys.executable, "-m", "torch.distributed.run"]
            command += ["--standalone", "--nproc_per_node=2"]
            command += [f"part4_torchrun/beyond_ddp/{script}", *TINY.split()]
            command += ["--epochs", "1", "--checkpoint", "", *flags]
            if script == "step8_drop_in.py":
                command += ["--snapshot", f"{folder}/{name}.pt"]
            done = subprocess.run(
                command, cwd=REPO, capture_output=True, text=True, timeout=600
            )
            if done.returncode:
                sys.exit(f"error: {name} failed:\n{done.stderr[-2000:]}")
            text.append(f"== {name}\n{done.stdout}")
    return "".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="saved", help="a saved output")
    parser.add_argument("--out", default=str(HERE / "memory.png"))
    args = parser.parse_args()
    text = Path(args.saved).read_text() if args.saved else run_all()
    draw(parse(text), args.out)
    print(f"drew {args.out}")


if __name__ == "__main__":
    main()
