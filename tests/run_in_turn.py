"""Run several of the course's scripts in turn, in one process: the tests launch this under
torchrun (or python) instead of one launch per script, and so start Python and import torch
once. Each script runs as its own `if __name__ == "__main__":` block does, `main(parse_args())`,
with its own sys.argv; its output opens with a line `script NAME`. A script that exits (an error)
ends the process with its exit status.

    torchrun --standalone --nproc_per_node=2 tests/run_in_turn.py \\
        A.py --flag value --- B.py --- C.py --other
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist


def split(words: list[str]) -> list[list[str]]:
    runs: list[list[str]] = [[]]
    for word in words:
        if word == "---":
            runs.append([])
        else:
            runs[-1].append(word)
    return [run for run in runs if run]


def launcher_store(launcher_port: int) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], launcher_port, is_master=False)


def wait_for_every_rank(turn: int, launcher_port: int) -> None:
    """Under torchrun, no rank opens the next script before every rank has ended this one: the
    output of one script comes whole before the next one's."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    key = f"run_in_turn/{os.environ['TORCHELASTIC_RUN_ID']}/{turn}/done"
    store = launcher_store(launcher_port)
    store.add(key, 1)
    while store.add(key, 0) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)


def fresh_store(turn: int, launcher_port: int) -> None:
    """Under torchrun, each script's group meets in a store of its own, hosted by rank 0 on a free
    port (named in the launcher's store): in the launcher's store, a group would find the keys
    of the one before, whose connections the FSDP2 scripts keep open (DTensor holds it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = launcher_store(launcher_port)
    key = f"run_in_turn/{os.environ['TORCHELASTIC_RUN_ID']}/{turn}"
    if os.environ["RANK"] == "0":
        with socket.socket() as free:
            free.bind((os.environ["MASTER_ADDR"], 0))
            launcher.set(key, str(free.getsockname()[1]))
    os.environ.update(MASTER_PORT=launcher.get(key).decode(), TORCHELASTIC_USE_AGENT_STORE="0")


def main() -> None:
    launcher_port = int(os.environ.get("MASTER_PORT", "0"))
    for turn, (script, *args) in enumerate(split(sys.argv[1:])):
        # One write, the newline with it: print() writes the line and its end apart, and the
        # other rank's line could land between them.
        sys.stdout.write(f"script {Path(script).name}\n")
        sys.stdout.flush()
        # Its folder first on the path, as `python SCRIPT` has it (overlap_bench imports a step).
        sys.path.insert(0, str(Path(script).resolve().parent))
        sys.argv = [script, *args]
        fresh_store(turn, launcher_port)
        namespace = runpy.run_path(script, run_name="run_in_turn")
        namespace["main"](namespace["parse_args"]())
        sys.path.pop(0)
        sys.stdout.flush()
        wait_for_every_rank(turn, launcher_port)
    sys.stdout.flush()
    # The FSDP2 scripts end so too: DTensor keeps the gloo group, which Python's teardown
    # could abort on (part4_torchrun/beyond_ddp/README.md).
    os._exit(0)


if __name__ == "__main__":
    main()
