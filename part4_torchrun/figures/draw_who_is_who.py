"""Draws who is who in a 2-node Slurm job, once per launcher: the nodes, the
srun tasks on each, and each process's rank, local rank and device, as
diagnose.py's rank 0 reports them (its `report` lines). Under srun a task is
one process; under torchrun a task is one node's torchrun, which starts the
node's processes and takes its ranks from the rendezvous.

    python part4_torchrun/figures/draw_who_is_who.py

runs `sbatch --wait part4_torchrun/tools/job_diagnose.sbatch` (diagnose.py
under srun, then under torchrun) on the Slurm cluster that SLURM_CONF names:
part4_torchrun/slurm/local/cluster.sh start 2, then eval "$(... env)", or
yours. It keeps the job's output beside the PNG (who_is_who.txt); --from
FILE draws a saved output instead; --out FILE: the PNG.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
JOB = "part4_torchrun/tools/job_diagnose.sbatch"
REPORT = re.compile(
    r"^report launcher=(?P<launcher>\S+) node=(?P<node>\S+)"
    r" task=(?P<task>\S+) rank=(?P<rank>\d+)/(?P<world>\d+)"
    r" local_rank=(?P<local_rank>\d+) host=\S+ device=(?P<device>\S+)",
    re.MULTILINE,
)
# Okabe-Ito: rank 0 stands out; every other rank alike
RANK0, RANK, TASK, NODE = "#D55E00", "#0072B2", "#000000", "#F2F2F2"
TITLES = {
    "srun": "srun starts one task per process (job_srun_*.sbatch):"
    "\nrank = SLURM_PROCID, local rank = SLURM_LOCALID",
    "torchrun": "srun starts one torchrun per node (job_torchrun_*.sbatch):"
    "\ntorchrun numbers its workers (LOCAL_RANK), its rendezvous the nodes"
    " (RANK)",
}


def parse(text: str) -> dict[str, list[dict]]:
    """Each launcher's processes, from its rank 0's report lines: node,
    task, rank, world size, local rank, device."""
    found: dict[str, list[dict]] = {}
    for match in REPORT.finditer(text):
        record = match.groupdict()
        for key in ("rank", "world", "local_rank"):
            record[key] = int(record[key])
        found.setdefault(record.pop("launcher"), []).append(record)
    if not found:
        raise ValueError("no `report` lines of diagnose.py in this output")
    return found


def nodes_in_order(processes: list[dict]) -> list[str]:
    # Slurm numbers a step's tasks node by node: the first node has task 0
    first = {}
    for p in processes:
        task = int(p["task"]) if p["task"].isdigit() else p["rank"]
        first[p["node"]] = min(first.get(p["node"], task), task)
    return sorted(first, key=first.get)


def draw_layout(axes, launcher: str, processes: list[dict]) -> None:
    import matplotlib.patches as patches

    nodes = nodes_in_order(processes)
    width, gap = 10 / len(nodes), 0.3
    for n, node in enumerate(nodes):
        left = n * width + gap / 2
        axes.add_patch(
            patches.FancyBboxPatch(
                (left, 0.1),
                width - gap,
                3.2,
                "round,pad=0.05",
                facecolor=NODE,
                edgecolor="#999999",
            )
        )
        axes.text(left + 0.1, 3.05, f"node {node}", va="top", fontsize=12)
        mine = sorted(
            (p for p in processes if p["node"] == node),
            key=lambda p: p["local_rank"],
        )
        tasks = sorted({p["task"] for p in mine}, key=str)
        task_width = (width - gap - 0.2) / len(tasks)
        for t, task in enumerate(tasks):
            inside = [p for p in mine if p["task"] == task]
            x0 = left + 0.1 + t * task_width
            axes.add_patch(
                patches.Rectangle(
                    (x0 + 0.05, 0.25),
                    task_width - 0.1,
                    2.3,
                    fill=False,
                    edgecolor=TASK,
                    linestyle="--",
                )
            )
            label = f"task {task}"
            if launcher == "torchrun":
                label += ": torchrun"
            axes.text(x0 + 0.15, 2.45, label, va="top", fontsize=12)
            box = (task_width - 0.2) / len(inside)
            for k, p in enumerate(inside):
                x = x0 + 0.1 + k * box
                color = RANK0 if p["rank"] == 0 else RANK
                axes.add_patch(
                    patches.FancyBboxPatch(
                        (x + 0.08, 0.4),
                        box - 0.16,
                        1.5,
                        "round,pad=0.03",
                        facecolor=color,
                        edgecolor="none",
                    )
                )
                text = (
                    f"rank {p['rank']}\nlocal rank {p['local_rank']}"
                    f"\n{p['device']}"
                )
                axes.text(
                    x + box / 2,
                    1.15,
                    text,
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=12,
                    linespacing=1.3,
                )
    axes.set_title(TITLES.get(launcher, launcher), loc="left", fontsize=12)
    axes.set(xlim=(0, 10), ylim=(0, 3.45))
    axes.axis("off")


def draw(data: dict[str, list[dict]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    launchers = [name for name in TITLES if name in data]
    launchers += [name for name in data if name not in TITLES]
    fig, rows = plt.subplots(
        len(launchers), 1, figsize=(9, 2.75 * len(launchers)), squeeze=False
    )
    for axes, launcher in zip(rows[:, 0], launchers, strict=True):
        draw_layout(axes, launcher, data[launcher])
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def run_job(log: Path, timeout: float = 900) -> str:
    """sbatch --wait the diagnose job from the repository root, its output
    into `log` (on the cluster's shared file system); the output's text. A
    job not done within `timeout` seconds (queue included) is cancelled."""
    command = ["sbatch", "--wait", "--parsable", f"--output={log}", JOB]
    job = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    job_id = job.stdout.readline().strip().split(";")[0]
    try:
        job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", job_id], timeout=60)
        job.kill()
        sys.exit(
            f"error: job {job_id} not done after {timeout:g} s: cancelled"
        )
    text = log.read_text() if log.exists() else ""
    if job.returncode != 0:
        sys.exit(f"error: job {job_id} failed ({' '.join(command)}):\n{text}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", help="a job's saved output")
    parser.add_argument("--out", default=str(HERE / "who_is_who.png"))
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.source:
        text = Path(args.source).read_text()
    else:
        text = run_job(out.with_suffix(".txt"))
    draw(parse(text), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
