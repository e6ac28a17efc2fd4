"""Why a job did not end well, from what the probe recorded: the first rank that raised on its
own, a read that raced a write, a loader worker that hung, a collective only some ranks called."""

from __future__ import annotations

import os
import re
from pathlib import Path

from conftest import Run

from .run import Training

# Where an exception raised by communication comes from: a rank that fails there usually
# fails because another rank left.
COMMUNICATION = ("torch/distributed/", "torch/nn/parallel/distributed.py")
# What an error of communication says wherever it is raised (a DDP model's backward(), whose
# all-reduce runs in C++ hooks, included): the transport lost its peer or timed out, or a
# collective met another of another size (DDP's all-reduce meeting one that some ranks skip).
TRANSPORT = re.compile(
    r"gloo/transport|Connection (reset|closed|refused) by peer|Broken pipe"
    r"|Received data size doesn't match|collective mismatch|NCCL (error|communicator)",
    re.IGNORECASE,
)


def crash_cause(t: Training) -> tuple[str, str | None]:
    """Why the job did not end well, and the step to blame (None: no step's line): the first
    rank that raised on its own (not in communication, where a rank fails because another
    left), a read that raced a write, a loader worker that hung, a collective that only some
    ranks called; else how the job ended."""
    ended = (
        f"the job timed out after {t.timeout:.0f} s"
        if t.run.timed_out
        else f"the job failed (exit {t.run.returncode})"
    )
    crashes = exceptions(t)
    own = [c for c in crashes if not c["in_communication"]]
    if own:
        first = own[0]
        race = unordered_reads(t, first["pid"])
        if race:
            return f"{race[0]}; it crashed: {first['what']}", "step 5"
        line = first["line"]
        place = f" at {t.where(line)}" if line else ""
        step = t.step_of(line) if line else None
        return f"rank {first['rank']} of {t.world} crashed{place}: {first['what']}", step
    hung = worker_hung(t)
    if hung:
        return hung, None
    victim = f": rank {crashes[0]['rank']} raised {crashes[0]['what']}" if crashes else ""
    skipped = collective_only_some_reach(t)
    if skipped:
        text, line = skipped
        return f"{text}; {ended}{victim}", t.step_of(line)
    error = victim or (f": {first_error(t.run)}" if first_error(t.run) else "")
    return ended + error, None


def exceptions(t: Training) -> list[dict]:
    """The exceptions that ended a rank, first first: rank, what (type: message), the line of
    the script it was raised from, and whether it was raised in communication (a collective
    the script called, torch.distributed's or DDP's own, or an error of the transport: a
    DDP model's backward() raises those)."""
    found = []
    for e in sorted(t.probe.events("exception"), key=lambda e: e["time"]):
        rank = t.rank_of(e["pid"])
        # A process that never joined the group (a crash before it) goes by its launcher's
        # rank, unless a process of that rank joined: then it is one of that rank's helpers.
        if rank is None and e.get("launcher_rank") not in t.pids:
            rank = e.get("launcher_rank")
        if rank is None:
            continue
        lines = [line for file, line, _ in e["frames"] if Path(file) == t.script]
        line = lines[-1] if lines else None
        called = {c["line"] for c in t.probe.events("collective") if c["pid"] == e["pid"]}
        inside = any(place in file for file, _, _ in e["frames"] for place in COMMUNICATION)
        inside = inside or bool(TRANSPORT.search(e["message"]))
        message = e["message"].strip().splitlines()
        what = e["type"] + (f": {short(message[0])}" if message else "")
        found.append(
            {
                "rank": rank,
                "pid": e["pid"],
                "what": what,
                "line": line,
                "in_communication": line in called or inside,
            }
        )
    return found


def short(message: str) -> str:
    """A message of the transport without gloo's source location and its advice: `Read error
    [127.0.0.1]:55936: Connection reset by peer.`"""
    if not TRANSPORT.search(message):
        return message
    message = re.sub(r"^\[[^\]]+:\d+\] ", "", message)
    return message.split(" This is typically")[0]


def endings(t: Training) -> list[str]:
    """How each rank ended: the exception it raised, else the last thing the probe saw it do."""
    raised = {c["pid"]: c for c in exceptions(t)}
    found = []
    for rank, pid in sorted(t.pids.items()):
        seen = [e for e in t.events(pid) if e["event"] in ("collective", "save", "load", "batch")]
        if pid in raised:
            line = raised[pid]["line"]
            place = f" at line {line}" if line else ""
            found.append(f"rank {rank} raised {raised[pid]['what']}{place}")
        elif any(e["event"] == "exit" for e in t.events(pid)):
            found.append(f"rank {rank} exited without an exception")
        elif seen:
            last = seen[-1]
            doing = {
                "collective": f"in dist.{last.get('name')}() at line {last.get('line')}",
                "save": f"in torch.save({Path(last.get('path', '')).name})",
                "load": f"in torch.load({Path(last.get('path', '')).name})",
                "batch": f"drawing a batch of loader {last.get('loader')}",
            }[last["event"]]
            found.append(f"rank {rank} was last {doing}")
    return found


def collective_only_some_reach(t: Training) -> tuple[str, int] | None:
    """The first collective of the script that one rank called and another never did."""
    calls: dict[int, list[tuple[str, int]]] = {}
    for rank, pid in t.pids.items():
        calls[rank] = [
            (e["name"], e["line"])
            for e in t.events(pid)
            if e["event"] == "collective" and Path(e["file"]) == t.script
        ]
    if len(calls) < 2:
        return None
    longest = max(calls, key=lambda rank: len(calls[rank]))
    for position, (name, line) in enumerate(calls[longest]):
        behind = [r for r, seen in calls.items() if seen[position : position + 1] != [(name, line)]]
        if not behind:
            continue
        callers = sorted(set(calls) - set(behind))
        called = f"{ranks(callers)} called dist.{name}() at {t.where(line)}"
        # every rank that never got there, and what each waited in instead
        elsewhere = [f"{ranks([r])} {waiting(t, r)}" for r in sorted(behind)]
        if not any(any(e["event"] == "exit" for e in t.events(t.pids[r])) for r in behind):
            # none exited by itself: killed, or busy elsewhere until the job was ended
            return f"{called}; {', '.join(elsewhere)}: never got there, never exited", line
        return (
            f"{called}; {', '.join(elsewhere)}: never reached it. A collective that only some"
            " ranks reach waits for the others until the timeout (or fails when they leave)."
            " Call it on every rank, outside `if rank == 0:`",
            line,
        )
    return None


def ranks(numbers: list[int]) -> str:
    """`rank 1`, `ranks 1 and 2`, `ranks 0, 1 and 2`."""
    told = [str(n) for n in numbers]
    if len(told) == 1:
        return f"rank {told[0]}"
    return f"ranks {', '.join(told[:-1])} and {told[-1]}"


def waiting(t: Training, rank: int) -> str:
    """Where a rank that never reached a collective was last seen: in which collective of the
    script, at which line; or that it exited."""
    pid = t.pids[rank]
    if any(e["event"] == "exit" for e in t.events(pid)):
        return "(exited)"
    last = [e for e in t.events(pid) if e["event"] == "collective"]
    if last and Path(last[-1]["file"]) == t.script:
        return f"(last in dist.{last[-1]['name']}() at line {last[-1]['line']})"
    return "(in none of the script's collectives)"


def worker_hung(t: Training) -> str | None:
    """A rank whose last record is a batch it handed to its loader's worker processes, while
    another rank waited in a collective: it waited for a worker that never answered. A worker
    forked (Linux's default start) while another thread of the rank held a lock can hang so,
    in a correct script."""
    calls = {
        pid: [e for e in t.events(pid) if e["event"] == "collective"] for pid in t.pids.values()
    }
    for rank, pid in sorted(t.pids.items()):
        last = (t.events(pid) or [{}])[-1]
        ahead = [seen[-1] for seen in calls.values() if len(seen) > len(calls[pid])]
        if last.get("event") == "batch" and last["workers"] and ahead:
            other = ahead[0]
            return (
                f"a DataLoader worker process hung (fork after threads): rank {rank} handed a"
                f" batch to its loader's worker processes ({last['start']}) and never got it"
                f" back, while rank {other['rank']} waited in dist.{other['name']}() at line"
                f" {other['line']}. Not the collective's fault: a worker forked while another"
                " thread (gloo's, a loader's, tqdm's) held a lock can wait for it forever."
                " Give the DataLoaders that have workers"
                ' multiprocessing_context="spawn", and run again'
            )
    return None


def first_error(run: Run) -> str | None:
    """The first exception or error line of any rank (torchrun prefixes them with [rankN]:)."""
    pattern = re.compile(
        r"^(\[rank\d+\]:)?\s*(\w[\w.]*(Error|Exception)\b.*|terminate called.*|error: .*)$"
    )
    for line in run.stderr.splitlines():
        if pattern.match(line):
            return line.strip()
    return None


def after_barriers(t: Training, pid: int | None, event: str) -> list[tuple[int, dict]]:
    """The process's `event` records, each with how many dist.barrier() calls came before."""
    barriers, found = 0, []
    for e in t.events(pid) if pid is not None else []:
        if e["event"] == "collective" and e["name"] == "barrier":
            barriers += 1
        elif e["event"] == event:
            found.append((barriers, e))
    return found


def unordered_reads(t: Training, pid: int | None = None) -> list[str]:
    """Reads of the checkpoint (or of any file rank 0 saved) by another rank that no
    dist.barrier() orders after rank 0 wrote it; of one process, or of all. Barriers pair up
    in call order on every rank: a read comes after the write when the reader had passed
    more barriers than rank 0 had called before writing."""
    written: dict[str, int] = {}
    for barriers, e in after_barriers(t, t.pids.get(0), "save"):
        written.setdefault(e["path"], barriers)
    files = set(written) | {os.path.abspath(t.checkpoint)}
    found = []
    for rank, reader in sorted(t.pids.items()):
        if rank == 0 or pid not in (None, reader):
            continue
        for barriers, e in after_barriers(t, reader, "load"):
            if e["path"] in files and barriers <= written.get(e["path"], barriers):
                found.append(
                    f"rank {rank} read {Path(e['path']).name} with no dist.barrier() after"
                    " rank 0's torch.save: it can read before rank 0 has written it (a missing"
                    " or half-written file). Put dist.barrier() between rank 0's save and"
                    " every other rank's read"
                )
    return found
