"""The diff contract: `diff -u` between consecutive teaching scripts shows one step and nothing
else, and fits on a projector: the course's steps and those of its beyond-DDP chapter. No
launches here: this file runs in about a second."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest
from conftest import REPO
from course_steps import BEYOND_STEPS, CEILING, CEILINGS, MAX_WIDTH, STEPS, Step

ALL_STEPS = [*STEPS, *BEYOND_STEPS]
DIFFS = [s for s in ALL_STEPS if s.before]
MAX_FLAGS = 11  # the mp.spawn steps: part 1's ten and --nprocs


def code_lines(path: str) -> list[str]:
    """The script's lines after its module docstring."""
    source = (REPO / path).read_text()
    docstring_end = ast.parse(source).body[0].end_lineno
    return source.splitlines()[docstring_end:]


def hunks(step: Step) -> list[tuple[list[str], list[str]]]:
    """(removed, added) lines of each hunk of the diff, without context: the lines `diff -u`
    shows. (difflib's default, autojunk, never pairs a line as common as a blank one inside a
    change, and counts blank lines that `diff -u` leaves as context.)"""
    before, after = code_lines(step.before), code_lines(step.script)
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    return [
        (
            [line for tag, i1, i2, _, _ in group if tag != "equal" for line in before[i1:i2]],
            [line for tag, _, _, j1, j2 in group if tag != "equal" for line in after[j1:j2]],
        )
        for group in matcher.get_grouped_opcodes(0)
    ]


@pytest.mark.parametrize("step", DIFFS, ids=lambda s: s.script)
def test_each_diff_shows_its_step_and_nothing_else(step: Step) -> None:
    diff = hunks(step)
    added = [line for _, plus in diff for line in plus]
    assert added, f"{step.script} adds nothing to {step.before}"
    for api in step.apis:
        assert any(api in line for line in added), f"{step.tag}: the diff should show {api!r}"
    for _, plus in diff:
        code = [line for line in plus if not line.lstrip().startswith(("import ", "from "))]
        on_topic = any(
            f"# {step.tag}" in line or any(a in line for a in step.apis) for line in code
        )
        assert not code or on_topic, f"{step.tag}: a hunk off the step's topic: {code}"
    changed = sum(len(minus) + len(plus) for minus, plus in diff)
    assert changed <= step.budget, f"{step.tag} changes {changed} lines, budget {step.budget}"
    ceiling = CEILINGS.get(step.label, CEILING)
    assert step.budget <= ceiling, f"{step.tag}: budget {step.budget} over the ceiling {ceiling}"


@pytest.mark.parametrize("step", DIFFS, ids=lambda s: s.script)
def test_diffs_open_on_code(step: Step) -> None:
    """A step has the module docstring of the script before it, so no diff opens on prose."""
    before, after = (ast.get_docstring(ast.parse((REPO / p).read_text())) for p in step.pair)
    assert before == after, f"{step.script}: another docstring than {step.before}'s"


@pytest.mark.parametrize("step", ALL_STEPS, ids=lambda s: s.script)
def test_teaching_scripts_are_standalone_and_short(step: Step) -> None:
    script = step.script
    text = (REPO / script).read_text()
    tree = ast.parse(text)
    repo_packages = {p.name for p in REPO.iterdir() if p.is_dir()}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{script}: relative import"
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in repo_packages, f"{script} imports {name} from the repo"
    lines = text.splitlines()
    limit = step.max_lines
    assert len(lines) <= limit, f"{script}: {len(lines)} lines, keep it to {limit}"
    assert max(map(len, lines)) <= MAX_WIDTH, f"{script}: a line over {MAX_WIDTH} characters"
    if step.spine:
        flags = text.count("add_argument(")
        assert flags <= MAX_FLAGS, f"{script}: {flags} flags, at most {MAX_FLAGS}"


@pytest.mark.parametrize("step", DIFFS, ids=lambda s: s.script)
def test_scripts_share_function_order(step: Step) -> None:
    """A step keeps the functions of the script before it, in their order, so a diff never
    shows a function that merely moved."""

    def functions(path: str) -> list[str]:
        tree = ast.parse((REPO / path).read_text())
        return [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]

    base = functions(step.before)
    present = [name for name in functions(step.script) if name in base]
    assert present == base, f"{step.script}: {step.before}'s functions missing or moved: {present}"


# ---- every teaching script at 79 columns (diff -u adds a column: 80), ruff's setting too ---
# The tools and the checker are not read on a projector: the house width (100), as the tests.
TOOLS = ("part4_torchrun/tools/", "part4_torchrun/your_script/checker/")
TEACHING = sorted(
    p.relative_to(REPO).as_posix()
    for pattern in ("part*/**/*.py", "exercises/*.py", "solutions/*.py")
    for p in REPO.glob(pattern)
    if not p.relative_to(REPO).as_posix().startswith(TOOLS)
)


def ruff_width(script: str) -> int:
    """The line length that the ruff.toml nearest the script sets (ruff's own rule)."""
    folder = (REPO / script).parent
    while not (folder / "ruff.toml").exists():
        assert folder != REPO, f"{script}: no ruff.toml sets its width"
        folder = folder.parent
    return int(re.search(r"^line-length = (\d+)", (folder / "ruff.toml").read_text(), re.M)[1])


@pytest.mark.parametrize("script", TEACHING)
def test_every_teaching_script_fits_79_columns(script: str) -> None:
    """The experiments, the chapters' scripts and the solutions too: no line wraps on a terminal
    or a projector, and the formatter keeps it so (`ruff format --check` in CI)."""
    lines = (REPO / script).read_text().splitlines()
    wide = [n for n, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert not wide, f"{script}: lines over {MAX_WIDTH} columns: {wide}"
    assert ruff_width(script) <= MAX_WIDTH, f"{script}: its ruff.toml allows wider lines"


def test_part4_lists_step6_and_one_folder_per_chapter() -> None:
    """`ls part4_torchrun` shows step 6, its README and folders; in each chapter's folder `ls`
    lists the steps in course order."""
    part4 = REPO / "part4_torchrun"
    files = sorted(p.name for p in part4.iterdir() if p.is_file())
    assert files == ["README.md", "ruff.toml", "train.py"], files
    for chapter in [
        [s for s in STEPS if s.label.startswith("speed")],
        [s for s in STEPS if s.label.isdigit() and int(s.label) >= 7],
        BEYOND_STEPS,
    ]:
        folders = {Path(s.script).parent for s in chapter}
        assert len(folders) == 1, f"one chapter, several folders: {folders}"
        (folder,) = folders
        listed = sorted(p.name for p in (REPO / folder).glob("*.py") if p.name.startswith("s"))
        assert listed == [Path(s.script).name for s in chapter], f"{folder}: `ls` order {listed}"
