"""Part 4's job scripts on a real Slurm cluster (1 or 2 nodes on this machine, started by
part4_torchrun/slurm/local/cluster.sh), the same multi-node run without Slurm (two torchruns),
and a failing rank ending the whole job. The tests submit the very files learners submit, with
sbatch: under sbatch --export=NONE with the environment loaded in the scripts' marked place, and
under the default --export=ALL; a job requeued near its time limit resumes from its snapshot."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import (
    PROBE_PATH,
    PYTHON,
    REPO,
    TEST_SAMPLES,
    TINY_RUN,
    TORCHRUN,
    TRAIN_SAMPLES,
    Probe,
    Run,
    assert_figure,
    free_port,
    import_script,
    launch,
    missing,
    png_size,
)
from mnist_data import (  # noqa: F401  (mnist_root, small_root: pytest fixtures)
    SMALL_TEST,
    SMALL_TRAIN,
    TEST_DIGITS,
    TRAIN_DIGITS,
    mnist_root,
    small_root,
)

pytestmark = pytest.mark.slow

CLUSTER_SCRIPT = REPO / "part4_torchrun" / "slurm" / "local" / "cluster.sh"
JOB_TIMEOUT = 240  # seconds; a healthy 4-process job takes ~30 s here, more while other tests run
# Every job's time limit: the part 4 job scripts requeue themselves 2 to 3 minutes before it
# (--signal), which must come after JOB_TIMEOUT, so that only a test sends that signal.
TIME_LIMIT = "--time=8"
FAILURE_DEADLINE = 30  # seconds from a rank's failure to the end of the whole job
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
RANK_LINE = re.compile(r"^rank (?P<rank>\d+)/(?P<world>\d+) device=", re.MULTILINE)
PER_NODE = 2  # processes per node with the job scripts' defaults
# Tests that need two nodes say "two_node" in their names: tests/conftest.py runs them on one
# pytest worker, with a 2-node cluster, and the 1-node tests on another, with a cluster of its own.
ONE_NODE_JOBS = [
    "part4_torchrun/slurm/job_srun_1node.sbatch",
    "part4_torchrun/slurm/job_torchrun_1node.sbatch",
]
TWO_NODE_JOBS = [
    "part4_torchrun/slurm/job_srun_2nodes.sbatch",
    "part4_torchrun/slurm/job_torchrun_2nodes.sbatch",
]
TORCHRUN_JOBS = [ONE_NODE_JOBS[1], TWO_NODE_JOBS[1], "solutions/job_ddp_torchrun.sbatch"]
# The exercises' job scripts (solutions/) on real digits, with their processes on one node;
# job_scaling.sbatch has a 2-node test of its own.
SOLUTION_JOBS = {
    "solutions/job_serial.sbatch": 1,
    "solutions/job_ddp_srun.sbatch": 2,
    "solutions/job_ddp_torchrun.sbatch": 2,
}


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def private_cluster() -> dict[str, str]:
    """Settings for a cluster of this test session's own, so that sessions running side by side
    (and a cluster you started yourself) never share daemons, ports or job ids (the job scripts
    derive their rendezvous port from the job id). DDP_SLURM_DIR set: use that cluster."""
    if "DDP_SLURM_DIR" in os.environ:
        return {}
    for slot in [(os.getpid() + i) % 200 for i in range(200)]:
        base = 12000 + 4 * slot  # controller, then one slurmd per node
        directory = Path(f"/tmp/ddp-course-slurm-test-{base}")
        if not directory.exists() and all(port_free(base + i) for i in range(3)):
            return {
                "DDP_SLURM_DIR": str(directory),
                "DDP_SLURM_PORT": str(base),
                "DDP_SLURM_FIRST_JOB_ID": str(1 + 100 * slot),
                # Two 2-CPU jobs fit on a node at once (more CPUs than cores: allowed here).
                "DDP_SLURM_CPUS": "4",
            }
    pytest.fail("no free slot for a private Slurm cluster in /tmp/ddp-course-slurm-test-*")


class Cluster:
    """The test session's Slurm cluster; it is stopped (and its directory removed) at the end."""

    def __init__(self) -> None:
        self.settings = private_cluster()
        exported = self.script("env").stdout  # "export SLURM_CONF=..."
        self.env = {"SLURM_CONF": exported.strip().split("=", 1)[1]}
        self.env["PATH"] = os.pathsep.join(
            [str(Path(PYTHON).parent), os.environ["PATH"]]
        )  # the jobs' python, torchrun

    def script(self, *args: str, check: bool = True) -> Run:
        return launch([str(CLUSTER_SCRIPT), *args], timeout=90, env=self.settings, check=check)

    def start(self, nodes: int) -> Cluster:
        self.script("start", str(nodes))  # a no-op when already up with `nodes`
        return self

    def stop(self) -> None:
        self.script("stop", check=False)
        if self.settings:
            shutil.rmtree(self.settings["DDP_SLURM_DIR"], ignore_errors=True)

    def job(self, job_id: str) -> dict[str, str]:
        shown = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            timeout=30,
        )
        return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)


@dataclass
class Job:
    id: str
    state: str
    exit_code: str  # "status:signal"
    ended: float  # time.time() when the test saw it end
    run: Run  # the job's stdout and stderr files, read back

    def describe(self) -> str:
        return f"job {self.id}: {self.state}, exit {self.exit_code}\n{self.run.describe()}"


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    absent = [
        p
        for p in ("sbatch", "scontrol", "slurmctld", "slurmd", "munged")
        if shutil.which(p) is None
    ]
    if absent:
        missing(
            f"Slurm is not installed ({', '.join(absent)} not found); "
            "apt-get install --no-install-recommends slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        missing("starting a Slurm cluster (slurmd) needs root")
    cluster = Cluster()
    yield cluster
    cluster.stop()


def submit(
    cluster: Cluster,
    script: str,
    args: list[str],
    tmp_path: Path,
    *,
    probe_dir: Path,
    env: dict[str, str] | None = None,
    sbatch_options: tuple[str, ...] = (),
    timeout: float = JOB_TIMEOUT,
) -> Job:
    """sbatch a job script (or --wrap=COMMAND) as a learner would, from the repository root;
    wait for its end, with a time limit on the job and a timeout on the wait."""
    job_id, command = start_job(
        cluster, script, args, tmp_path, probe_dir=probe_dir, env=env, sbatch_options=sbatch_options
    )
    return wait_for(cluster, job_id, command, tmp_path, timeout)


def start_job(
    cluster: Cluster,
    script: str,
    args: list[str],
    tmp_path: Path,
    *,
    probe_dir: Path,
    env: dict[str, str] | None = None,
    sbatch_options: tuple[str, ...] = (),
) -> tuple[str, list[str]]:
    """submit() without the wait: (the job id, the sbatch command)."""
    command = [
        "sbatch",
        "--parsable",
        TIME_LIMIT,
        f"--output={tmp_path}/job-%j.out",
        f"--error={tmp_path}/job-%j.err",
        *sbatch_options,
        script,
        *args,
    ]
    submitted = launch(command, timeout=30, probe_dir=probe_dir, env={**cluster.env, **(env or {})})
    return submitted.stdout.strip().split(";")[0], command


def sbatch_only(
    cluster: Cluster, args: list[str], probe_dir: Path, env: dict[str, str] | None = None
) -> str:
    """Submit without waiting; returns the job id."""
    command = ["sbatch", "--parsable", TIME_LIMIT, *args]
    submitted = launch(command, timeout=30, probe_dir=probe_dir, env={**cluster.env, **(env or {})})
    return submitted.stdout.strip().split(";")[0]


def wait_for(
    cluster: Cluster, job_id: str, command: list[str], tmp_path: Path, timeout: float = JOB_TIMEOUT
) -> Job:
    """Wait for a job's end; read its output files back. At the timeout (a hang, or a request
    larger than the cluster, which would wait forever) cancel the job, wait for Slurm to end it,
    and fail with "timed out" first."""
    deadline = time.monotonic() + timeout
    info = cluster.job(job_id)
    while info.get("JobState") not in FINISHED:
        if time.monotonic() > deadline:
            reason = info.get("Reason", "None")
            was = info.get("JobState", "?") + (f" ({reason})" if reason != "None" else "")
            subprocess.run(["scancel", job_id], env={**os.environ, **cluster.env}, timeout=30)
            cancelled = time.monotonic() + 10
            while info.get("JobState") not in FINISHED and time.monotonic() < cancelled:
                time.sleep(0.2)
                info = cluster.job(job_id)
            pytest.fail(
                f"timed out after {timeout:g} s: job {job_id} was {was}, cancelled, now"
                f" {info.get('JobState')}\n" + read_job(job_id, command, tmp_path, info).describe()
            )
        time.sleep(0.2)
        info = cluster.job(job_id)
    ended = time.time()
    return Job(
        job_id, info["JobState"], info["ExitCode"], ended, read_job(job_id, command, tmp_path, info)
    )


def wait_for_probe(cluster: Cluster, job_id: str, probe_dir: Path, *events: str) -> None:
    """Wait until the job's processes have recorded each of `events` (a fault a test injected,
    in place); cancel the job and fail if it ends first or JOB_TIMEOUT passes."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        recorded = "".join(path.read_text() for path in probe_dir.glob("*.jsonl"))
        if all(f'"event": "{event}"' in recorded for event in events):
            return
        state = cluster.job(job_id).get("JobState")
        if state in FINISHED or time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env={**os.environ, **cluster.env}, timeout=30)
            pytest.fail(f"job {job_id} ({state}): its processes never recorded {events}")
        time.sleep(0.2)


def read_job(job_id: str, command: list[str], tmp_path: Path, info: dict[str, str]) -> Run:
    output = [(tmp_path / f"job-{job_id}.{kind}") for kind in ("out", "err")]
    return Run(
        command,
        int(info.get("ExitCode", "-1:0").split(":")[0]),
        *(p.read_text() if p.exists() else "" for p in output),
    )


def assert_trained(run: Run, probe: Probe, *, nodes: int, per_node: int, checkpoint: Path) -> None:
    """World size, every rank's global and local rank and node, the epoch, one checkpoint
    by rank 0."""
    world = nodes * per_node
    lines = [{k: int(v) for k, v in m.groupdict().items()} for m in RANK_LINE.finditer(run.stdout)]
    assert sorted(line["rank"] for line in lines) == list(range(world)), (
        f"one 'rank' line per process\n{run.describe()}"
    )
    assert {line["world"] for line in lines} == {world}, (
        f"every process must see world size {world}\n{run.describe()}"
    )
    assert [e["world_size"] for e in probe.events("init")] == [world] * world, (
        "init_process_group's world size"
    )
    probe.assert_groups_released()
    node_of = {e["rank"]: e["node"] for e in probe.events("node")}
    local_rank_of = {e["rank"]: e["local_rank"] for e in probe.events("node")}
    assert len(set(node_of.values())) == nodes, f"ranks per node: {node_of}"
    for node in set(node_of.values()):
        ranks = sorted(r for r, n in node_of.items() if n == node)
        local_ranks = {r: local_rank_of[r] for r in ranks}
        assert len(ranks) == per_node, (
            f"node {node} ran ranks {ranks}, expected {per_node} processes"
        )
        assert ranks == list(range(ranks[0], ranks[0] + per_node)), (
            f"node {node}: ranks {ranks} not consecutive"
        )
        assert local_ranks == {r: r - ranks[0] for r in ranks}, (
            f"node {node}: local ranks {local_ranks}"
        )
    epochs = run.epochs()
    assert len(epochs) == 1, (
        f"training must finish its epoch, reported once by rank 0\n{run.describe()}"
    )
    assert (epochs[0]["train_samples"], epochs[0]["test_samples"]) == (TRAIN_SAMPLES, TEST_SAMPLES)
    # Every file (step11_locked_snapshot.py's snapshots too) is written by global rank 0, not
    # one per node; the checkpoint once.
    saves = [(e["rank"], e["path"]) for e in probe.events("save")]
    assert {rank for rank, _ in saves} == {0}, f"writers: {saves}"
    assert [path for _, path in saves].count(str(checkpoint.resolve())) == 1, saves
    assert checkpoint.exists() and run.stdout.count("saved checkpoint") == 1


def tiny_run(checkpoint: Path, epochs: int = 1) -> list[str]:
    return [*TINY_RUN, "--epochs", str(epochs), "--checkpoint", str(checkpoint)]


def job_args(folder: Path, epochs: int = 1) -> list[str]:
    """The tiny run for step11_locked_snapshot.py, which part 4's job scripts run: its checkpoint
    and snapshot in `folder`, not in the repository's runs/."""
    return [*tiny_run(folder / "model.pt", epochs), "--snapshot", str(folder / "snapshot.pt")]


def with_environment(
    script: str, tmp_path: Path, probe_dir: Path, variables: dict[str, str]
) -> str:
    """A copy of a job script with an environment loaded in its marked place, as a user at a
    site with sbatch --export=NONE writes it: the venv's PATH, the test probe, `variables`.
    Like many module and conda scripts it reads a variable that is unset there (PYTHONPATH),
    which `set -u` would turn into an error."""
    lines = [
        f'export PATH="{Path(PYTHON).parent}:$PATH"',
        f'export PYTHONPATH="{PROBE_PATH}:$PYTHONPATH"',
        f'export DDP_PROBE_DIR="{probe_dir}"',
        *(f'export {name}="{value}"' for name, value in variables.items()),
    ]
    text = (REPO / script).read_text()
    marked = "\n\nset -euo pipefail\n"  # the place the comment above it names
    assert text.count(marked) == 1, f"{script}: no place for the environment before set -u"
    copy = tmp_path / f"hooked-{Path(script).name}"
    copy.write_text(text.replace(marked, "\n" + "\n".join(lines) + marked))
    return str(copy)


# --- one node ---
# job_torchrun_1node.sbatch trains in the test of two jobs from one directory below;
# job_srun_1node.sbatch starts in the tests of a hang and of jobs that cannot work, and its
# twin job_srun_2nodes.sbatch (the same lines, --nodes=2) trains in the two-node tests.


@pytest.mark.parametrize("script", SOLUTION_JOBS, ids=lambda s: Path(s).stem)
def test_solution_job_script_trains_on_mnist(
    slurm: Cluster,
    script: str,
    small_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
) -> None:
    cluster = slurm.start(1)
    checkpoint = tmp_path / "ckpt" / "mnist.pt"
    # The default loader settings: worker processes feed each rank's batches. Under
    # --export=NONE, DATA_DIR too comes from the environment loaded in the job script.
    args = ["--epochs", "1", "--checkpoint", str(checkpoint)]
    # 400 training and 99 test digits: the job's lines are under test, not the learning.
    hooked = with_environment(script, tmp_path, probe_dir, {"DATA_DIR": str(small_root)})
    job = submit(
        cluster, hooked, args, tmp_path, probe_dir=probe_dir, sbatch_options=("--export=NONE",)
    )
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()
    processes = SOLUTION_JOBS[script]
    probe = Probe.read(probe_dir)
    check_training_runs(
        job, probe, [processes], serial="serial" in script, digits=(SMALL_TRAIN, SMALL_TEST)
    )
    workers = {e["workers"] for e in probe.events("batch") if e["loader"] == 0}
    assert workers and 0 not in workers, f"training loader worker processes: {workers}"
    # With the defaults, a rank that waits for a collective the others never reach fails
    # within a minute.
    timeouts = {e["timeout_s"] for e in probe.events("init")}
    assert timeouts == (set() if "serial" in script else {60.0}), f"collective timeouts: {timeouts}"
    probe.assert_groups_released()


def check_training_runs(
    job: Job,
    probe: Probe,
    runs: list[int],
    serial: bool = False,
    digits: tuple[int, int] = (TRAIN_DIGITS, TEST_DIGITS),
) -> None:
    """One epoch line per training run with global counts of `digits` (training, test); every
    process in a world of its run's size; one checkpoint per run, by rank 0 (no process group,
    no rank: serial)."""
    epochs = job.run.epochs()
    assert len(epochs) == len(runs), f"one epoch line per training run\n{job.describe()}"
    assert all((e["train_samples"], e["test_samples"]) == digits for e in epochs), job.describe()
    worlds = sorted(e["world_size"] for e in probe.events("init"))
    assert worlds == ([] if serial else [n for n in runs for _ in range(n)]), (
        f"world size of every process: {worlds}"
    )
    saves = [e["rank"] for e in probe.events("save")]
    assert saves == [None if serial else 0] * len(runs), (
        f"one checkpoint per run, by rank 0: {saves}"
    )


def test_train_py_tells_the_batch_step_from_an_srun_step(
    slurm: Cluster, tmp_path: Path, probe_dir: Path
) -> None:
    """In a job of 2 tasks the batch script itself has SLURM_PROCID=0 and SLURM_NTASKS=2: train.py
    run there without srun must train alone (a world of one), not wait for a rank 1 that never
    comes. Inside an srun step whose job script exported no MASTER_ADDR, every task must say in
    one line what to export instead of a traceback."""
    cluster = slurm.start(1)
    train = f"{PYTHON} part4_torchrun/train.py {' '.join(TINY_RUN)} --epochs 1 --checkpoint ''"
    wrap = f"{train} && srun --kill-on-bad-exit=1 {train} || echo srun exit $?"
    job = submit(
        cluster, f"--wrap={wrap}", [], tmp_path, probe_dir=probe_dir, sbatch_options=("--ntasks=2",)
    )
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()
    worlds = RANK_LINE.findall(job.run.stdout)
    assert worlds == [("0", "1")], f"the batch step is a world of one\n{job.describe()}"
    assert len(job.run.epochs()) == 1, job.describe()
    assert "srun exit 1" in job.run.stdout, f"the srun step must fail\n{job.describe()}"
    # The variables it lacks, by name, in one line ("[...]" also names SLURM_NTASKS_PER_NODE
    # where srun was given no --ntasks-per-node). At least one task says so: the first to
    # exit makes srun (--kill-on-bad-exit=1) kill the other, maybe before it prints.
    error = "error: under srun, set ['MASTER_ADDR', 'MASTER_PORT'"
    assert 1 <= job.run.stderr.count(error) <= 2, job.describe()
    assert "Traceback" not in job.run.stderr, job.describe()


# Where a job is stopped before its signal: rank 0, first epoch (pass 0), third batch. With
# --snapshot-every 1 its snapshot then holds 2 of the epoch's 4 steps (128 images, 2 ranks, 16
# per batch).
PAUSE_AT = (0, 0, 2)
STEPS_PER_EPOCH = TRAIN_SAMPLES // (2 * 16)


def test_two_jobs_from_one_directory_keep_their_files_and_a_requeued_one_resumes(
    slurm: Cluster, tmp_path: Path
) -> None:
    """job_torchrun_1node.sbatch submitted twice at once from one directory, with all its
    defaults (both fit on the node at once, each on ports of its own): each writes its snapshot
    and checkpoint into runs/<job id>/ and its log into <job name>-<job id>.out. The first gets,
    mid-epoch, the signal that --signal=B:USR1@120 sends 2 minutes before the time limit: it
    requeues itself, starts again from the top with the same job id, adds to its log, resumes
    from its snapshot and ends with the weights of the second, which nothing interrupted."""
    cluster = slurm.start(1)
    work = tmp_path / "work"
    work.mkdir()
    (work / "part4_torchrun").symlink_to(REPO / "part4_torchrun")
    script = str(REPO / ONE_NODE_JOBS[1])
    options = [f"--chdir={work}", script, *TINY_RUN, "--epochs", "1", "--snapshot-every", "1"]
    probes = [tmp_path / f"probe{n}" for n in range(2)]
    for probe_dir in probes:
        probe_dir.mkdir()
    pause = {"DDP_PROBE_PAUSE_AT": ":".join(map(str, PAUSE_AT))}
    ids = [
        sbatch_only(cluster, options, probes[0], pause),
        sbatch_only(cluster, options, probes[1]),
    ]
    # Rank 0 of the first job stops at the pause (its first start only); then the signal, as
    # Slurm sends it: to the batch shell alone.
    wait_for_probe(cluster, ids[0], probes[0], "paused")
    signal = ["scancel", "--batch", "--signal=USR1", ids[0]]
    subprocess.run(signal, env={**os.environ, **cluster.env}, check=True, timeout=30)
    jobs = [wait_for(cluster, i, options, tmp_path) for i in ids]

    logs = [(work / f"ddp-torchrun-1node-{job.id}.out").read_text() for job in jobs]
    for job, log in zip(jobs, logs, strict=True):
        assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), log
        assert f"saved checkpoint runs/{job.id}/checkpoint.pt" in log, log
        assert (work / "runs" / job.id / "snapshot.pt").exists(), "the snapshot in runs/<job id>/"
    plain = jobs[1]
    checkpoint = work / "runs" / plain.id / "checkpoint.pt"
    assert_trained(
        Run(options, 0, logs[1], ""),
        Probe.read(probes[1]),
        nodes=1,
        per_node=PER_NODE,
        checkpoint=checkpoint,
    )
    # The requeued job: one log with both starts, in order; the second resumed at the step
    # its snapshot holds, and trained only the steps left of the epoch.
    requeued, log = jobs[0], logs[0]
    said = [
        f"job {requeued.id}: start 1 on",
        f"job {requeued.id}: time limit near: requeueing, to resume from runs/{requeued.id}/",
        f"job {requeued.id}: start 2 on",
        f"resumed from runs/{requeued.id}/snapshot.pt: 0/1 epochs, {PAUSE_AT[2]} steps done",
    ]
    assert all(line in log for line in said), log
    assert [log.index(line) for line in said] == sorted(log.index(line) for line in said), log
    # Between the two starts, the lines the fault-tolerance chapter says to expect: Slurm's,
    # with `error:`, and torchrun's, stopped; the job completes all the same.
    between = log[log.index(said[1]) : log.index(said[2])]
    assert f"error: *** JOB {requeued.id} ON " in between and "DUE TO JOB REQUEUE" in between
    assert "Received 15 death signal" in between, between
    assert cluster.job(requeued.id)["Restarts"] == "1", "requeued once"
    epochs = Run(options, 0, log, "").epochs()
    left = (STEPS_PER_EPOCH - PAUSE_AT[2]) * TRAIN_SAMPLES // STEPS_PER_EPOCH
    assert [e["train_samples"] for e in epochs] == [left], log
    final = [torch.load(work / "runs" / job.id / "checkpoint.pt") for job in jobs]
    differ = [name for name in final[1] if not torch.equal(final[0][name], final[1][name])]
    assert not differ, f"the requeued job's weights differ from the other's: {differ}"
    assert not (work / "checkpoint.pt").exists(), "no job may write the shared default"


def test_job_scripts_that_cannot_work_stop_at_once_in_one_line(
    slurm: Cluster, tmp_path: Path, probe_dir: Path
) -> None:
    """Submitted together: a job under --export=NONE whose script loads no environment (no
    venv on PATH) and every torchrun job script with an --ntasks-per-node=2 copied from an srun
    job. Each ends at once, before any training, with one error line that names the fix."""
    cluster = slurm.start(1)
    no_environment = "error: no python with torch here"
    two_per_node = "error: torchrun runs as one task per node, but this job has 2 tasks on 1 node"
    cases = [(ONE_NODE_JOBS[0], ("--export=NONE",), no_environment)]
    # --nodes=1: the 2-node script too, on this cluster's one node.
    layout = ("--ntasks-per-node=2", "--cpus-per-task=1", "--nodes=1")
    cases += [(script, layout, two_per_node) for script in TORCHRUN_JOBS]
    started = [
        start_job(cluster, script, TINY_RUN, tmp_path, probe_dir=probe_dir, sbatch_options=options)
        for script, options, _ in cases
    ]
    for (job_id, command), (script, _, expected) in zip(started, cases, strict=True):
        job = wait_for(cluster, job_id, command, tmp_path)
        assert job.state == "FAILED" and job.exit_code == "1:0", job.describe()
        lines = job.run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected), f"{script}: {lines}"
        fix = "load your environment" if expected == no_environment else "--ntasks-per-node=1"
        assert fix in lines[0], lines
        assert "rank 0/" not in job.run.stdout, "nothing may start training"


# Seconds the test waits once both ranks stand in place (rank 1 hanging, rank 0 waiting for
# it): far below the collective timeout (PyTorch's default, 30 minutes), so only the
# test's own timeout can end the job.
HANG_TIMEOUT = 10


def test_a_hang_in_a_job_ends_at_the_timeout_with_no_process_left(
    slurm: Cluster, tmp_path: Path, probe_dir: Path
) -> None:
    """Rank 1 never reaches init_process_group, so rank 0 waits for it there. At the test's
    timeout the job is cancelled; Slurm must end every task within seconds, and the report must
    start with "timed out"."""
    cluster = slurm.start(1)
    job_id, command = start_job(
        cluster,
        "part4_torchrun/slurm/job_srun_1node.sbatch",
        job_args(tmp_path),
        tmp_path,
        probe_dir=probe_dir,
        env={"DDP_PROBE_HANG_RANK": "1"},
    )
    # Starting Python and torch takes long on a loaded machine: the timeout counts from there.
    wait_for_probe(cluster, job_id, probe_dir, "hang", "waiting")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        wait_for(cluster, job_id, command, tmp_path, timeout=HANG_TIMEOUT)
    seconds = time.monotonic() - start
    report = str(failure.value)
    assert report.startswith(f"timed out after {HANG_TIMEOUT} s"), report[:500]
    assert seconds < HANG_TIMEOUT + 10, f"the job took {seconds:.0f} s to end"
    assert "now CANCELLED" in report, report[:500]
    probe = Probe.read(probe_dir)
    assert [e["rank"] for e in probe.events("hang")] == [1], report
    assert [e["rank"] for e in probe.events("waiting")] == [0], f"rank 0 must wait\n{report}"
    survivors = probe.survivors()
    assert not survivors, f"processes left running after the cancel: {survivors}"


# --- two nodes ---


@pytest.mark.parametrize("script", TWO_NODE_JOBS, ids=lambda s: Path(s).stem)
def test_two_node_job_script_trains_under_export_none(
    slurm: Cluster, script: str, tmp_path: Path, probe_dir: Path
) -> None:
    """The job script under sbatch --export=NONE, its environment loaded in its marked place:
    srun must hand that environment on to the tasks (the probe's records come only from
    processes that got it). The srun job with 2 cores per task, where its own rule gives each
    process 2 threads, and an OMP_NUM_THREADS=1 in that environment: the user's value wins."""
    srun = "srun" in script
    variables = {"OMP_NUM_THREADS": "1"} if srun else {}
    hooked = with_environment(script, tmp_path, probe_dir, variables)
    options = ("--export=NONE", *(["--cpus-per-task=2"] if srun else []))
    job = submit(
        slurm.start(2),
        hooked,
        job_args(tmp_path / "ckpt"),
        tmp_path,
        probe_dir=probe_dir,
        sbatch_options=options,
    )
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()
    checkpoint = tmp_path / "ckpt" / "model.pt"
    assert_trained(
        job.run, Probe.read(probe_dir), nodes=2, per_node=PER_NODE, checkpoint=checkpoint
    )
    threads = re.findall(r"^rank \d+/4 device=cpu threads=(\d+)$", job.run.stdout, re.MULTILINE)
    assert threads == ["1"] * 4, f"threads per process\n{job.describe()}"


WHO_IS_WHO = REPO / "part4_torchrun" / "figures" / "draw_who_is_who.py"


def who_is_who():
    """part4_torchrun/figures/draw_who_is_who.py as a module: parse(text), draw(data, path)."""
    return import_script(WHO_IS_WHO)


def assert_who_is_who(data: dict[str, list[dict]], nodes: int, per_node: int) -> None:
    """What the figure shows, from diagnose.py's report lines: under srun a task per process,
    its rank the task's number, the tasks node by node; under torchrun a task per node, whose
    workers have consecutive ranks and local ranks 0, 1, ...; every rank once, on `nodes`
    nodes with `per_node` processes each."""
    world = nodes * per_node
    assert sorted(data) == ["srun", "torchrun"], sorted(data)
    for launcher, processes in data.items():
        assert sorted(p["rank"] for p in processes) == list(range(world)), (launcher, processes)
        assert {p["world"] for p in processes} == {world}, processes
        by_node: dict[str, list[dict]] = {}
        for p in sorted(processes, key=lambda p: p["rank"]):
            by_node.setdefault(p["node"], []).append(p)
        assert len(by_node) == nodes, (launcher, sorted(by_node))
        for mine in by_node.values():
            ranks = [p["rank"] for p in mine]
            assert ranks == list(range(ranks[0], ranks[0] + per_node)), (launcher, mine)
            assert [p["local_rank"] for p in mine] == list(range(per_node)), (launcher, mine)
            tasks = {p["task"] for p in mine}
            if launcher == "srun":
                assert [p["task"] for p in mine] == [str(r) for r in ranks], mine
            else:
                assert len(tasks) == 1, f"one torchrun task per node: {mine}"
        if launcher == "torchrun":
            assert sorted(p["task"] for p in processes) == sorted(
                str(n) for n in range(nodes) for _ in range(per_node)
            ), processes


def test_two_node_diagnose_job_under_srun_and_torchrun_draws_who_is_who(
    slurm: Cluster, tmp_path: Path, probe_dir: Path
) -> None:
    """part4_torchrun/tools/job_diagnose.sbatch on 2 nodes: diagnose.py under srun (a task per
    process), then under torchrun (a task per node). Its report lines are the figure's data
    (part4_torchrun/figures/who_is_who.png): parse() and draw() run on them, and what the
    figure shows holds. One process per node keeps the job to 4 torch processes and 2 agents
    (12 CPU-s here); the committed figure's own 2 x 2 run (who_is_who.txt) is checked alike."""
    job = submit(
        slurm.start(2),
        "part4_torchrun/tools/job_diagnose.sbatch",
        [],
        tmp_path,
        probe_dir=probe_dir,
        sbatch_options=("--ntasks-per-node=1",),
    )
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()
    assert job.run.stdout.count("OK 2 rank(s) on 2 node(s)") == 2, job.describe()
    figure = who_is_who()
    data = figure.parse(job.run.stdout)
    assert_who_is_who(data, nodes=2, per_node=1)
    figure.draw(data, tmp_path / "who.png")
    assert png_size(tmp_path / "who.png") == (900, 550)
    # The committed figure's run: 2 nodes of 2 processes.
    assert_who_is_who(figure.parse(WHO_IS_WHO.with_name("who_is_who.txt").read_text()), 2, 2)
    assert png_size(WHO_IS_WHO.with_name("who_is_who.png")) == (900, 550)


# One process per node, set on the command line (srun) or with the documented variable (torchrun).
ONE_PER_NODE = {
    "srun": ("part4_torchrun/slurm/job_srun_2nodes.sbatch", ("--ntasks-per-node=1",), {}),
    "torchrun": ("part4_torchrun/slurm/job_torchrun_2nodes.sbatch", (), {"NPROC_PER_NODE": "1"}),
}


def test_scaling_job_on_two_nodes_keeps_small_runs_on_one_node(
    slurm: Cluster,
    mnist_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_notebook,
) -> None:
    """job_scaling.sbatch on 2 nodes x 2 tasks runs 1, 2 and 4 processes: the 2-process run must
    sit on one node (intra-node only), the 4-process run on both. Its CSV is what the scaling
    notebook plots: speedup and efficiency 1 for 1 process, and a PNG."""
    cluster = slurm.start(2)
    csv = tmp_path / "scaling.csv"
    args = ["--", "--epochs", "1", "--workers", "0", "--checkpoint", str(tmp_path / "m.pt")]
    job = submit(
        cluster,
        "solutions/job_scaling.sbatch",
        args,
        tmp_path,
        probe_dir=probe_dir,
        env={"DATA_DIR": str(mnist_root), "CSV": str(csv)},
        sbatch_options=("--nodes=2",),
    )
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()
    probe = Probe.read(probe_dir)
    world_of = {e["pid"]: e["world_size"] for e in probe.events("init")}
    nodes_of: dict[int, set[str]] = {}
    for event in probe.events("node"):
        nodes_of.setdefault(world_of[event["pid"]], set()).add(event["node"])
    assert {world: len(nodes) for world, nodes in nodes_of.items()} == {1: 1, 2: 1, 4: 2}, nodes_of
    check_training_runs(job, probe, [1, 2, 4])
    rows = [line.split(",") for line in csv.read_text().splitlines()]
    assert rows[0] == ["processes", "launcher", "samples_per_s", "epoch_s", "test_acc"], rows
    assert [(r[0], r[1]) for r in rows[1:]] == [("1", "srun"), ("2", "srun"), ("4", "srun")]
    for _, _, rate, seconds, accuracy in rows[1:]:
        assert float(rate) * float(seconds) == pytest.approx(TRAIN_DIGITS, rel=0.02), (
            "samples/s x epoch_s = samples"
        )
        assert float(accuracy) > 50, "one epoch already learns something"

    png = tmp_path / "scaling.png"
    monkeypatch.setenv("SCALING_CSV", str(csv))
    monkeypatch.setenv("SCALING_PNG", str(png))
    notebook = run_notebook(REPO / "solutions/scaling_analysis.ipynb", cwd=REPO, timeout=120)
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs)
    assert re.search(r"^\s+1 .* 1\.00\s+1\.00$", printed, re.M), (
        f"1 process: speedup 1, efficiency 1\n{printed}"
    )
    # What the exercises' figure plots, from the CSV: S(n) = rate(n) / rate(1), E(n) = S(n) / n.
    table = re.findall(
        r"^\s+(\d+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+%\s+([\d.]+)\s+([\d.]+)$", printed, re.M
    )
    rates = {int(r[0]): float(r[2]) for r in rows[1:]}
    assert [int(n) for n, *_ in table] == [1, 2, 4], printed
    for n, _, speedup, efficiency in table:
        expected = rates[int(n)] / rates[1]
        assert float(speedup) == pytest.approx(expected, abs=0.006), (n, printed)
        assert float(efficiency) == pytest.approx(expected / int(n), abs=0.006), (n, printed)
    assert_figure(png, "solutions/figures/scaling.png")


@pytest.mark.parametrize("launcher", ONE_PER_NODE)
def test_a_failing_rank_ends_the_whole_two_node_job(
    slurm: Cluster, launcher: str, tmp_path: Path, probe_dir: Path
) -> None:
    """Rank 1 (second node) dies at start-up; rank 0 would wait for it in the rendezvous for half
    an hour (job_srun_2nodes.sbatch without --kill-on-bad-exit does). The job must end, non-zero,
    within seconds, with no process left."""
    cluster = slurm.start(2)
    script, sbatch_options, env = ONE_PER_NODE[launcher]
    world = 2
    job = submit(
        cluster,
        script,
        job_args(tmp_path, epochs=50),
        tmp_path,
        probe_dir=probe_dir,
        env={**env, "DDP_PROBE_FAIL_RANK": str(world - 1)},
        sbatch_options=sbatch_options,
    )
    probe = Probe.read(probe_dir)
    failures = probe.events("fail")
    assert [f["rank"] for f in failures] == [world - 1], (
        f"the injected failure did not happen\n{job.describe()}"
    )
    assert job.state == "FAILED" and job.exit_code != "0:0", job.describe()
    seconds = job.ended - failures[0]["time"]
    assert seconds < FAILURE_DEADLINE, (
        f"the job ran on for {seconds:.0f} s after rank {world - 1} failed"
    )
    assert not probe.events("final"), "no rank may finish training without the failed one"
    survivors = probe.survivors()
    assert not survivors, f"processes of the failed job still running: {survivors}"


# --- no Slurm ---


def test_two_torchruns_train_as_two_nodes_without_slurm(tmp_path: Path, probe_dir: Path) -> None:
    """What srun does in job_torchrun_2nodes.sbatch, by hand: one torchrun per "node", meeting
    at a c10d rendezvous on 127.0.0.1 (one worker each: the Slurm tests above run two per node)."""
    checkpoint, port = tmp_path / "ckpt" / "model.pt", free_port()
    command = [
        TORCHRUN,
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=test-{port}",
        "part4_torchrun/train.py",
        *tiny_run(checkpoint),
    ]

    def node(name: str) -> Run:
        # Two "nodes" share this machine's cores: one thread each, or they oversubscribe them.
        return launch(
            command,
            timeout=JOB_TIMEOUT,
            probe_dir=probe_dir,
            env={"DDP_PROBE_NODE": name, "OMP_NUM_THREADS": "1"},
        )

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(node, ["node-a", "node-b"]))
    both = Run(
        command,
        max(r.returncode for r in runs),
        "".join(r.stdout for r in runs),
        "".join(r.stderr for r in runs),
    )
    assert_trained(both, Probe.read(probe_dir), nodes=2, per_node=1, checkpoint=checkpoint)


# Linux's default ephemeral ports (net.ipv4.ip_local_port_range), where outgoing connections
# take their local port: a rendezvous port there may already be taken.
EPHEMERAL = range(32768, 61000)
# The job scripts' rule: $((... SLURM_JOB_ID ...)), the job's first port.
PORT_RULE = re.compile(r"\$\(\([^()]*SLURM_JOB_ID[^()]*\)\)")
# "ids differ by less than N", also across comment lines
STATED_SPACING = re.compile(r"differ[\s#]+by[\s#]+less[\s#]+than[\s#]+(\d+)")


def test_the_job_port_rule_without_slurm() -> None:
    """One rule, in every job script, README and tool, derives the port from the job id; each
    job owns ten ports from there (job_scaling.sbatch gives each srun step the next one). All of
    them stay below Linux's ephemeral ports, and the smallest difference of job ids that shares
    a port is the one the files state. The rule is run by bash, as the job scripts run it."""
    texts = {
        path.relative_to(REPO): path.read_text()
        for path in REPO.rglob("*")
        if path.suffix in {".sbatch", ".md", ".py", ".sh"}
        and not {".venv", ".git", "tests"} & set(path.relative_to(REPO).parts)
    }
    found = {(str(path), rule) for path, text in texts.items() for rule in PORT_RULE.findall(text)}
    rules = {rule for _, rule in found}
    assert len(rules) == 1, f"more than one rule: {sorted(found)}"
    rule = rules.pop()
    # Every job script that names a first node (all but the serial one) uses the rule.
    with_ports = [p for p, text in texts.items() if p.suffix == ".sbatch" and "hostnames" in text]
    assert with_ports and all(rule in texts[p] for p in with_ports), with_ports
    stated = {int(n) for text in texts.values() for n in STATED_SPACING.findall(text)}

    last = 20_000
    loop = f"for SLURM_JOB_ID in $(seq 1 {last}); do echo {rule}; done"
    ports = [int(p) for p in launch(["bash", "-c", loop], timeout=60).stdout.split()]
    assert len(ports) == last
    # Above the local clusters' daemons (ports 12000-12819: cluster.sh, private_cluster()),
    # below the ephemeral ports.
    assert min(ports) > 12_819 and max(ports) + 9 < EPHEMERAL.start, (min(ports), max(ports))
    # The smallest id difference between two jobs that share one of their ten ports.
    holder: dict[int, int] = {}
    closest = last
    for job_id, first in enumerate(ports, start=1):
        for port in range(first, first + 10):
            if port in holder:
                closest = min(closest, job_id - holder[port])
            holder[port] = job_id
    assert stated == {closest}, f"the files state {stated}; ids {closest} apart share a port"
