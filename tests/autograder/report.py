"""The report of a grading, and the log it points to."""

from __future__ import annotations

from .causes import endings
from .claims import Finding, failing
from .run import Training


def table(findings: list[Finding]) -> list[str]:
    """A line per claim: its mark, step and text, then its evidence, cause or why not checked."""
    mark = {"ok": " ok ", "FAIL": "FAIL", "--": " -- "}
    rows = []
    for f in findings:
        text = f"not checked: {f.text}" if f.status == "--" else f.text
        rows.append(f"  [{mark[f.status]}] {f.claim.step}: {f.claim.text}: {text}")
    return rows


def report(findings: list[Finding], t: Training) -> str:
    """On success: every claim with its evidence. On failure, in ten lines or so: the first
    failure with its cause (the headline: the first in step order, or one that accounts for
    the job's crash), once; the other failures; when the job failed, how each rank ended; a
    count of the rest and the log that holds everything. (pytest's summary line repeats the
    headline at the end.)"""
    failed = list(failing(findings).values())
    write_log(findings, t)
    name = f"{t.target.script}, {t.target.launcher} on {t.world} ranks"
    if not failed:
        return "\n".join([f"{name}: every claim checked holds", *table(findings), f"log: {t.log}"])
    headline = failed[0].headline
    lines = [headline]
    # (a failure the headline or an earlier line already tells, as a crash's cause or the
    # cause of two claims, is not told again)
    told = {headline}
    for f in failed[1:]:
        if not any(f.text in line for line in told):
            lines.append(f"  also {f.claim.step}: {f.text}")
            told.add(lines[-1])
    if t.failed:
        lines += [f"  {ending}" for ending in endings(t)]
    held = sum(f.status == "ok" for f in findings)
    unchecked = sum(f.status == "--" for f in findings)
    holding = "1 claim holds" if held == 1 else f"{held} claims hold"
    lines.append(
        f"  {holding}, {unchecked} not checked ({name}); every claim with its evidence, and"
        f" the job's whole output: {t.log}"
    )
    return "\n".join(lines)


def write_log(findings: list[Finding], t: Training) -> None:
    """The whole story, in t.log, for the report to point at: every claim, the exceptions
    with their frames, the command and the job's output."""
    parts = ["every claim, in step order:", *table(findings), ""]
    for e in t.probe.events("exception"):
        rank = t.rank_of(e["pid"])
        frames = [f"    {file}:{line} in {function}" for file, line, function in e["frames"]]
        parts += [f"pid {e['pid']} (rank {rank}) raised {e['type']}: {e['message']}", *frames]
    # (the fake srun's bash script is left out of its command line)
    command = t.run.command[3:] if t.run.command[:2] == ["bash", "-c"] else t.run.command
    parts += [
        "",
        f"$ {' '.join(command)}",
        f"exit {t.run.returncode}" + (" (timed out)" if t.run.timed_out else ""),
        "--- stdout ---",
        t.run.stdout,
        "--- stderr ---",
        t.run.stderr,
    ]
    t.log.write_text("\n".join(parts))
