"""The diff contract: `diff -u` between consecutive teaching scripts shows one step and nothing
else, and fits on a projector: the course's steps and those of its beyond-DDP chapter. No
launches here: this file runs in about a second."""

from __future__ import annotations

import ast
import difflib

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
