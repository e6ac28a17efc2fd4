"""Shared helpers for the course's tests: launch real scripts under real launchers, with a
timeout, and read what they did (their output and the probe records, see probe/)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE_PATH = Path(__file__).resolve().parent / "probe"
PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
# The your-own-script chapter; its checker for any script (the recorder's folder, and the
# command that launches a script under it); the chapter's launcher: 2 gloo ranks.
YOUR_SCRIPT = "part4_torchrun/your_script"
CHECKER_PATH = REPO / YOUR_SCRIPT / "checker"
CHECKER_COMMAND = [PYTHON, str(CHECKER_PATH / "ddp_check.py")]
TORCHRUN_2 = [TORCHRUN, "--standalone", "--nproc_per_node=2"]

# A tiny timm ResNet on a small fake CIFAR-10: the real code paths, seconds of compute.
TINY_RUN = [
    "--dataset",
    "fake",
    "--fake-size",
    "128",
    "--model",
    "test_resnet",
    "--batch-size",
    "16",
]
TRAIN_SAMPLES = 128
TEST_SAMPLES = 128 // 5

EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<epochs>\d+) train_loss=(?P<train_loss>[\d.]+)"
    r" train_acc=(?P<train_acc>[\d.]+)% train_samples=(?P<train_samples>\d+)"
    r" test_acc=(?P<test_acc>[\d.]+)% test_samples=(?P<test_samples>\d+)"
    r" samples/s=(?P<samples_per_s>[\d.]+) epoch_s=(?P<epoch_s>[\d.]+)$",
    re.MULTILINE,
)


def missing(reason: str) -> None:
    """Skip a test whose prerequisite is absent, except under CI, which must have it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must provide this, but: {reason}")
    pytest.skip(reason)


@dataclass
class Run:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.command)}\nexit {self.returncode}\n"
            f"--- stdout ---\n{self.stdout[-4000:]}"
            f"\n--- stderr ---\n{self.stderr[-4000:]}"
        )

    def epochs(self) -> list[dict[str, float]]:
        return [
            {k: float(v) for k, v in m.groupdict().items()}
            for m in EPOCH_LINE.finditer(self.stdout)
        ]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc: torchrun starts its workers in sessions of
    their own, so killing the launcher's process group would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """A zombie is dead: read the state from /proc, not with kill -0."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


def with_environ(entry: str) -> list[int]:
    """Live processes whose environment holds `entry` ("NAME=value"): a launch's processes,
    orphans and loader workers included, whoever their parent is now."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry.encode() in environ.read_bytes().split(b"\0"):
                pid = int(environ.parent.name)
                if alive(pid):
                    found.append(pid)
        except (OSError, ValueError):
            continue
    return found


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid`, its process group and every descendant; returns the pids killed."""
    victims = [pid, *descendants(pid)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    return victims


def wait_until_in_place(
    process: subprocess.Popen, in_place: Callable[[], bool], within: float
) -> tuple[str, str] | None:
    """The process's output if it ended before `in_place()` held, else None once it holds;
    TimeoutExpired if neither happened within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            return process.communicate(timeout=0.5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ValueError):  # a record half written as it was read
                if in_place():
                    return None
            if time.monotonic() > deadline:
                raise


def launch(
    command: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    probe_dir: Path | None = None,
    check_dir: Path | None = None,
    cwd: Path = REPO,
    check: bool = True,
    fail_on_timeout: bool = True,
    before_kill: Callable[[], None] | None = None,
    in_place: Callable[[], bool] | None = None,
    in_place_within: float = 120,
) -> Run:
    """Run a command in its own process group; on timeout call `before_kill` (e.g. to make
    every process dump its stacks), kill the whole group and everything below it, then fail
    (or, with fail_on_timeout=False, return a Run with timed_out set).
    probe_dir: the probe records into it; check_dir: the checker's recorder records into it
    (first on the path: its sitecustomize loads the probe's after it).
    in_place: for a run that is meant to hang, the timeout counts from the moment this returns
    True (polled twice a second; e.g. the probe saw every rank where it should wait), at most
    `in_place_within` seconds after the start: a start-up slowed by a loaded machine costs no
    test a longer fixed wait."""
    full_env = {
        k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"
    }  # let the scripts choose
    full_env["PYTHONUNBUFFERED"] = "1"  # the hardest case for whole-line output
    recorders = {
        CHECKER_PATH: ("DDP_CHECK_DIR", check_dir),
        PROBE_PATH: ("DDP_PROBE_DIR", probe_dir),
    }
    used = [path for path, (_, directory) in recorders.items() if directory is not None]
    if used:
        full_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [*map(str, used), full_env.get("PYTHONPATH")])
        )
    for path in used:
        variable, directory = recorders[path]
        full_env[variable] = str(directory)
    full_env.update(env or {})
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    waited, output = f"timed out after {timeout} s", None
    try:
        if in_place:
            waited = f"not in place after {in_place_within} s"
            output = wait_until_in_place(process, in_place, in_place_within)
            waited = f"timed out after {timeout} s in place"
        stdout, stderr = output or process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if before_kill is not None:
            before_kill()
        killed = kill_tree(process.pid)
        try:
            stdout, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(the output pipes stayed open after the kill)"
        if not fail_on_timeout:
            return Run(command, -9, stdout, stderr, timed_out=True)
        pytest.fail(
            f"{waited}; killed {len(killed)} process(es)\n"
            + Run(command, -9, stdout, stderr).describe()
        )
    run = Run(command, process.returncode, stdout, stderr)
    if check and run.returncode != 0:
        pytest.fail("command failed\n" + run.describe())
    return run


@dataclass
class Probe:
    """What the probe recorded, per process, for one run."""

    directory: Path
    records: list[dict] = field(default_factory=list)

    @classmethod
    def read(cls, directory: Path) -> Probe:
        records = []
        for path in sorted(directory.glob("*.jsonl")):
            pid = int(path.stem)
            records += [dict(json.loads(line), pid=pid) for line in path.read_text().splitlines()]
        return cls(directory, records)

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["event"] == kind]

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the process that had it."""
        return {r["rank"]: r["pid"] for r in self.events("init")}

    def indices(self, rank: int | None, loader: int = 0, epoch: int = 0) -> list[int]:
        """Sample indices, in order, that `rank`'s loader number `loader` drew in pass `epoch`."""
        return [
            i
            for r in self.events("batch")
            if r["rank"] == rank and r["loader"] == loader and r["pass"] == epoch
            for i in r["indices"]
        ]

    def assert_groups_released(self, context: str = "") -> None:
        """Every rank exits with its process group released: no gloo thread left when Python
        shuts down (a rank that recorded no exit fails too). A group torn down during interpreter
        shutdown can abort the process after correct results."""
        exits = {e["rank"]: e["gloo_threads"] for e in self.events("exit")}
        unreleased = {r: exits.get(r) for r in self.ranks() if exits.get(r) != 0}
        assert not unreleased, (
            f"gloo threads still running at exit, per rank: {unreleased}\n{context}"
        )

    def survivors(self, grace: float = 5.0) -> list[int]:
        """This run's processes still running after `grace` seconds. A SIGKILLed process takes a
        moment to die, and a pid may be reused by someone else meanwhile: a process counts as
        ours only while its environment still names this probe directory."""
        ours = f"DDP_PROBE_DIR={self.directory}".encode()
        deadline = time.monotonic() + grace
        while True:
            left = []
            for pid in sorted({r["pid"] for r in self.records}):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if alive(pid) and ours in environ:
                    left.append(pid)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def params(self, pid: int) -> list:
        import torch

        return torch.load(self.directory / f"{pid}.params.pt", weights_only=True)

    def assert_own_crops(self, world_size: int) -> None:
        """Each rank drew its own crops and flips, from equal weights (a run with
        DDP_PROBE_FIRST_STEP=1). The augmentation draws from torch's generator: after the first
        batch it stands in another state on every rank (one seed for all: the same state, the
        same crops). The weights of the first step are equal: DDP broadcast rank 0's."""
        import torch

        first = {
            e["rank"]: torch.load(self.directory / f"{e['pid']}.first_step.pt", weights_only=True)
            for e in self.events("first_step")
        }
        assert sorted(first) == list(range(world_size)), "one first step per rank"
        for rank in range(1, world_size):
            assert not torch.equal(first[0]["rng"], first[rank]["rng"]), (
                f"ranks 0 and {rank} drew from the same random state: the same crops and flips"
            )
            pairs = zip(first[0]["params"], first[rank]["params"], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), f"rank {rank} began with other weights"


def launch_at_once(
    commands: list[list[str]],
    *,
    timeout: float,
    check: bool = True,
    at_once: int = 0,
    envs: list[dict[str, str] | None] | None = None,
) -> list[Run]:
    """launch() each command (with its entry of `envs`), `at_once` at a time (0: all), each in
    a process group of its own and under its own timeout; the runs in the commands' order."""
    from concurrent.futures import ThreadPoolExecutor

    envs = envs or [None] * len(commands)
    with ThreadPoolExecutor(at_once or len(commands)) as pool:
        futures = [
            pool.submit(launch, command, timeout=timeout, check=check, env=env)
            for command, env in zip(commands, envs, strict=True)
        ]
        return [future.result() for future in futures]


def import_script(path: Path | str, name: str | None = None):
    """A script of the repository (a path from its root, or absolute) as a module, imported once
    per test process under `name` (default: made from its path, so that part 1's and part 4's
    train.py stay apart): its functions without its __main__. Registered before it runs:
    dataclasses look their module up while they are made."""
    path = REPO / path
    name = name or "script_" + re.sub(r"\W", "_", str(path.relative_to(REPO).with_suffix("")))
    module = sys.modules.get(name)
    if module is None or Path(module.__file__).resolve() != path.resolve():
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def checker():
    """The checker's report half (ddp_check.py) as a module: report(directory, returncode),
    read(directory), loaders(ranks)."""
    return import_script(CHECKER_PATH / "ddp_check.py", "ddp_check")


# ---- the chapters' figures: PNGs drawn by a figures/draw_<topic>.py script ---------------------
FIGURE_WIDTH = 900  # px: 9 in at 100 dpi, a README's width
FIGURE_MAX_HEIGHT = 550  # px: 5.5 in
FIGURE_MAX_BYTES = 150_000


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's header."""
    header = Path(path).read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is no PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def assert_figure(path: Path, committed: Path | None = None) -> None:
    """A PNG that draw() wrote has the house size (900 px wide, at most 550 px high); the
    committed one, if named, exists and stays small."""
    width, height = png_size(path)
    assert width == FIGURE_WIDTH and height <= FIGURE_MAX_HEIGHT, (path, width, height)
    if committed is not None:
        committed = REPO / committed
        assert committed.exists(), f"{committed} is not committed"
        assert committed.stat().st_size < FIGURE_MAX_BYTES, f"{committed} is over 150 kB"


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "probe"
    directory.mkdir()
    return directory


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def run_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Execute a notebook end to end in a kernel that runs this very interpreter (whatever
    kernels are installed); the first failing cell fails the test. Returns the executed notebook."""
    import nbformat  # in requirements.txt: a missing one is an error, not a skip
    from nbclient import NotebookClient

    name = "ddp-course-tests"
    spec_dir = tmp_path / "jupyter" / "kernels" / name
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [PYTHON, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name,
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv(
        "JUPYTER_PATH",
        os.pathsep.join(filter(None, [str(tmp_path / "jupyter"), os.environ.get("JUPYTER_PATH")])),
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def run(path: Path, cwd: Path, timeout: int = 300):
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(
            notebook, kernel_name=name, timeout=timeout, resources={"metadata": {"path": str(cwd)}}
        ).execute()
        return notebook

    return run


def pytest_configure(config: pytest.Config) -> None:
    """Grading a learner's script (DDP_EXERCISE_SCRIPT, tests/test_exercises.py): the grader's
    report is the output. The short summary gives the verdict whole (below -vv, pytest trims it
    to the terminal's width), a passing grade shows its claims with their evidence (-rP), and
    the timing table is left out."""
    if os.environ.get("DDP_EXERCISE_SCRIPT"):
        config.option.verbose = max(config.option.verbose, 2)
        config.option.reportchars = "fEsP"
        config.option.durations = None


# ---- how pytest-xdist shares the tests out among its workers -----------------------------------


def work_unit(nodeid: str) -> str:
    """Tests that share a costly set-up run in one unit, on one worker: test_failures.py's
    snapshot runs serve two of its tests, test_errors_chapter.py's launches all of its tests,
    test_beyond_ddp.py's two runs in turn serve all of its tests, test_your_script_classes.py's
    launches (from one warm interpreter) all of its tests, and each worker that runs Slurm
    tests starts a cluster of its own, so test_slurm.py's tests go in two units, those on one
    node and those on two (named so). Every other test is a unit of its own."""
    file, _, name = nodeid.partition("::")
    if file in (
        "tests/test_failures.py",
        "tests/test_errors_chapter.py",
        "tests/test_beyond_ddp.py",
        "tests/test_your_script_classes.py",
    ):
        return file
    if file == "tests/test_slurm.py" and "without_slurm" not in name:
        return f"{file}::{'two nodes' if 'two_node' in name else 'one node'}"
    return nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class BigUnitsFirst(LoadScopeScheduling):
        # Units with more tests are handed out first (xdist's default order): the three big
        # ones start at once, each on a worker of its own, and the single tests fill in.
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return BigUnitsFirst(config, log)


# ---- a warm torchrun: the agent and the ranks forked from one interpreter that imported torch ---

WARM_PYTHON = [PYTHON, str(REPO / "tests" / "warm_python.py")]


@contextlib.contextmanager
def warm_interpreter(directory: Path, timeout: float = 120):
    """tests/warm_python.py serving in `directory`: yields its socket's path; ended with every
    process it forked. One thread per process, as torchrun gives each of several ranks (the
    OpenMP runtime reads OMP_NUM_THREADS when torch is imported, in the server)."""
    import select

    path = str(directory / "socket")
    server = subprocess.Popen(
        [*WARM_PYTHON, "serve", path],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # "ready" once it imported torch and listens; a start-up that hangs ends here.
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        line = server.stdout.readline() if ready else "(nothing)"
        assert line == "ready\n", f"the warm interpreter did not start within {timeout} s: {line}"
        yield path
    finally:
        kill_tree(server.pid)
        server.wait()


def warm_torchrun(socket: str, script: str, *args: str, nproc: int = 2) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N SCRIPT ARGS`, with torchrun's own code (its
    agent, rendezvous, environment, exit status and failure report) forked from the warm
    interpreter, and each rank too: torchrun's `--no-python` starts `warm_python.py worker`
    in place of `python -u`. A launch then costs its own work, not three imports of torch and
    two of torch._dynamo (about 7 CPU-s here). For launches whose processes need nothing at
    start-up (the checker's and the probe's recorders load as each interpreter starts: those
    launches keep the real torchrun)."""
    spec = importlib.util.find_spec("torch")
    run_py = str(Path(spec.submodule_search_locations[0]) / "distributed" / "run.py")
    launcher = ["--standalone", f"--nproc_per_node={nproc}", "--no-python"]
    return [*WARM_PYTHON, "run", socket, run_py, *launcher, *WARM_PYTHON, "worker", socket,
            script, *args]  # fmt: skip
