"""The README is the course map: the files it names exist and the flags its commands pass
are flags the scripts define. (The commands themselves run in the other test files.)"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from conftest import REPO
from course_steps import BEYOND_STEPS, STEPS
from test_diff_contract import hunks

README_FILES = sorted(
    p.relative_to(REPO)
    for p in REPO.glob("**/README.md")
    if not any(part.startswith(".") for part in p.relative_to(REPO).parts)
)  # every course page, at any depth; not .pytest_cache's or .venv's
SCRIPT = re.compile(r"[\w./-]+\.(?:py|sbatch|sh|ipynb)\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def code_blocks(text: str) -> list[str]:
    """Shell code blocks (```bash, ```sh, ```console or none); ```text logs are not commands."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    return [body for language, body in blocks if language in ("", "bash", "sh", "console")]


def inline_code(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)  # fenced blocks out
    return re.findall(r"`([^`\n]+)`", prose)


def commands(text: str) -> list[str]:
    """Shell commands from code blocks and inline code, continuation lines joined."""
    lines = [
        line for block in code_blocks(text) for line in block.replace("\\\n", " ").splitlines()
    ]
    lines += [
        code
        for code in inline_code(text)
        if code.split()[0] in ("python", "torchrun", "srun", "sbatch", "diff")
    ]
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


@cache
def defined_flags(script: Path) -> frozenset[str]:
    flags = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and str(a.value).startswith("-")
            }
    return frozenset(flags | {"-h", "--help"})


@pytest.mark.parametrize("readme", README_FILES, ids=str)
def test_named_files_and_links_exist(readme: Path) -> None:
    text = (REPO / readme).read_text()
    base = (REPO / readme).parent
    named = {m for block in [*code_blocks(text), *inline_code(text)] for m in SCRIPT.findall(block)}
    missing = [
        name
        for name in named
        if "/" in name and not (REPO / name).exists() and not (base / name).exists()
    ]
    assert not missing, f"{readme} names files that do not exist: {missing}"
    links = [link for link in LINK.findall(text) if "://" not in link]
    assert not [link for link in links if not (base / link).exists()], f"{readme}: broken links"


@pytest.mark.parametrize("readme", README_FILES, ids=str)
def test_command_flags_exist(readme: Path) -> None:
    base = (REPO / readme).parent
    for command in commands((REPO / readme).read_text()):
        try:
            words = shlex.split(command)
        except ValueError:
            continue
        scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
        if not scripts or "pytest" in words:  # pytest's flags are pytest's
            continue
        path = next(
            (p for p in (REPO / words[scripts[0]], base / words[scripts[0]]) if p.exists()), None
        )
        if path is None:
            continue  # reported by the test above
        own_words = words[scripts[0] + 1 :]
        own_words = (
            own_words[: own_words.index("--")] if "--" in own_words else own_words
        )  # the rest is passed on
        # A wrapper's own command (ddp_check.py torchrun ... script.py) starts at its launcher.
        nested = [i for i, w in enumerate(own_words) if w in ("torchrun", "python", "srun")]
        own_words = own_words[: nested[0]] if nested else own_words
        passed = {w.split("=")[0] for w in own_words if w.startswith("-")}
        unknown = passed - defined_flags(path)
        assert not unknown, (
            f"{readme}: `{command}` passes {sorted(unknown)}, which {path.name} does not define"
        )


@pytest.mark.parametrize("readme", README_FILES, ids=str)
def test_diff_excerpts_match_the_scripts(readme: Path) -> None:
    """Each ```diff excerpt is a piece of one real diff: its removed lines are lines of a step's
    script before, its added lines lines of the step's own (tests/course_steps.py), or both are
    lines of one script (a chapter's script and its --fix branch). A README that walks an old
    diff, or mixes two, fails."""
    text = (REPO / readme).read_text()
    blocks = re.findall(r"^```diff\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    folder = (REPO / readme).parent
    paths = {*folder.glob("*.py"), *REPO.glob("part*/**/*.py"), *REPO.glob("[es]*s/*.py")}
    lines = {p.relative_to(REPO).as_posix(): p.read_text().splitlines() for p in paths}
    lines = {name: {line.rstrip() for line in got} for name, got in lines.items()}
    # the course's steps; any two scripts of the README's own folder (a chapter's steps); one
    # script against itself (a --fix branch)
    here = sorted(p.relative_to(REPO).as_posix() for p in folder.glob("*.py"))
    pairs = [(s.before, s.script) for s in [*STEPS, *BEYOND_STEPS] if s.before]
    pairs += [(a, b) for a in here for b in here] + [(n, n) for n in lines]
    for block in blocks:
        removed, added = (
            {line[1:].rstrip() for line in block.splitlines() if line[:1] == sign} - {""}
            for sign in "-+"
        )
        assert any(
            removed <= lines.get(before, set()) and added <= lines.get(after, set())
            for before, after in pairs
        ), f"{readme}: this diff is no step's and no script's:\n{block}"


def test_course_map_lists_the_steps() -> None:
    """The README's course map is the step list of tests/course_steps.py, in its order: each
    row's label, script, lesson, and the launcher of its quick run, which runs that script."""
    text = (REPO / "README.md").read_text()
    course_map = text.split("## The course map", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in course_map.splitlines()
        if line.startswith("| ") and not line.startswith("| Step ")
    ]
    found = []
    for label, script, teaches, command, _ in rows:
        words = shlex.split(command.strip("`"))
        # Leading VARIABLE=value words set the environment; the launcher comes after them.
        launcher = next(w for w in words if "=" not in w)
        link = LINK.search(script).group(1)
        found.append((label, link, teaches, launcher, link in words))
    expected = [(s.label, s.script, s.teaches, s.launcher, True) for s in STEPS]
    assert found == expected, "the README's course map and tests/course_steps.py differ"


# A figure still to come: "not measured yet", "TBD", or an elided number ("... ms").
PLACEHOLDER = re.compile(r"not measured yet|\bTBD\b|\.\.\. ?(?:ms|s|%|GB/s|samples/s)\b", re.I)


def test_no_placeholder_on_any_page() -> None:
    """Every figure on a course page is measured (or cited), never promised."""
    pages = [p for p in REPO.rglob("*.md") if not {".venv", ".git"} & set(p.parts)]
    found = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if PLACEHOLDER.search(line)
    ]
    assert not found, "placeholders:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "step", [s for s in [*STEPS, *BEYOND_STEPS] if s.before], ids=lambda s: s.script
)
def test_readme_walks_every_hunk(step) -> None:
    """The README of each step's folder (part 2, part 3, part 4, the beyond-DDP chapter) quotes
    each hunk of the step's diff in a ```diff block (at least one of its changed lines, as a + or
    - line), with its why around it; a hunk of imports alone needs none."""
    text = ((REPO / step.script).parent / "README.md").read_text()
    blocks = re.findall(r"^```diff\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    quoted = {line.rstrip() for block in blocks for line in block.splitlines() if line[:1] in "+-"}
    for removed, added in hunks(step):
        changed = [f"-{line}" for line in removed] + [f"+{line}" for line in added]
        changed = [line.rstrip() for line in changed if line[1:].strip()]
        imports = all(line[1:].startswith(("import ", "from ")) for line in changed)
        assert imports or set(changed) & quoted, f"{step.script}: a hunk not walked: {changed}"


# ---- every page and job script: the files it names and the anchors it links ---------------------
PAGES = sorted(
    p.relative_to(REPO)
    for pattern in ("**/*.md", "**/*.sbatch")
    for p in REPO.glob(pattern)
    if not any(part.startswith(".") for part in p.relative_to(REPO).parts)
)
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation out (hyphens and
    underscores kept), spaces to hyphens, a repeated one numbered."""
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n, unique = 0, slug
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_pages_and_job_scripts_name_no_missing_file(page: Path) -> None:
    """A path with a folder in it, anywhere on a page or in a job script (prose, code, comments),
    names a file that exists: from the repository root, where the commands run, or from the
    page's folder. A renamed or moved script leaves no old name behind."""
    text = (REPO / page).read_text()
    base = (REPO / page).parent
    # not a URL's tail (https://github.com/.../file.py), an elided path (.../file.py) or a shell
    # default's dash (${SCRIPT:-solutions/...})
    named = {
        m.lstrip("-") for m in re.findall(r"(?<![\w./:-])-?" + SCRIPT.pattern, text) if "/" in m
    }
    named = {n for n in named if not n.startswith(("//", "..."))}
    # torch's own sources, as a page cites them (torch/distributed/...): in the installed torch
    torch_root = Path(importlib.util.find_spec("torch").origin).parent.parent
    missing = sorted(
        n for n in named if not any((root / n).exists() for root in (REPO, base, torch_root))
    )
    assert not missing, f"{page} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.suffix == ".md"], ids=str)
def test_links_land_on_a_heading(page: Path) -> None:
    """Every link to a page of the course, with or without #anchor, lands on the page and on
    one of its headings."""
    text = FENCE.sub("", (REPO / page).read_text())
    base = (REPO / page).parent
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (base / target) if target else (REPO / page)
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}#{anchor} (no such heading)")
    assert not broken, f"{page}: broken links: {broken}"
