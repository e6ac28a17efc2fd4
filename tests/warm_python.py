"""`python SCRIPT ARGS` without importing torch again: a server imports torch once and forks a
child for each script, which runs it as `python SCRIPT` would (`__main__`, its argv, folder on
the path, environment, working directory, standard streams, exit status). For tests that launch
many scripts which fork their ranks themselves (the errors chapter): each launch then costs its
own work, not one more import of torch (about 3 s of CPU here, with torch._dynamo).

    python tests/warm_python.py serve SOCKET            # imports torch, then forks on request
    python tests/warm_python.py run SOCKET SCRIPT ARGS  # as `python SCRIPT ARGS`; no torch here

The `run` client is what a test launches (conftest.launch): it passes its standard streams to
the server, so the script's output is the client's, and exits with the script's status (128 +
N for signal N, as a shell says it). Killing the client kills the script and every process in
its session: the forked child watches the client's connection and ends the session when it
closes.

    python tests/warm_python.py worker SOCKET SCRIPT ARGS  # `run`, ended with its parent

`worker` is `run` for a client that a launcher starts, one per rank: torchrun's agent, given
`--no-python PYTHON tests/warm_python.py worker SOCKET` before the script, starts each rank as
such a client, so the ranks are forked from the warm interpreter too (conftest.warm_torchrun).
The agent starts each worker in a session of its own; the client dies with the agent (Linux's
parent-death signal), so an agent killed on a timeout takes its ranks along.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time


def run(path: str, argv: list[str]) -> int:
    """The client: one script's request, then its exit status."""
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(path)
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reply = b""
        while chunk := connection.recv(64):
            reply += chunk
    if not reply:
        print("warm_python: the server ended the script without a status", file=sys.stderr)
        return 1
    return int(reply)


def worker(path: str, argv: list[str]) -> int:
    """A launcher's worker: `run`, and SIGKILL when the launcher that started it dies
    (PR_SET_PDEATHSIG; the parent that died before the call is checked after it)."""
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        return 128 + signal.SIGKILL
    return run(path, argv)


def script_main(request: dict, fds: list[int]) -> None:
    """In the script's process: become `python SCRIPT ARGS`, run it, exit as Python does."""
    import atexit
    import runpy
    import threading

    os.setsid()
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # What Python does on its way out: wait for threads, then the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def watch(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """Between the server and the script: fork the script, send its status, or end its session
    if the client goes away first (killed on a timeout)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        connection.close()
        script_main(request, fds)
    for fd in fds:
        os.close(fd)
    connection.setblocking(False)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            connection.setblocking(True)
            connection.sendall(str(code if code >= 0 else 128 - code).encode())
            return
        try:
            gone = connection.recv(1) == b""
        except BlockingIOError:
            gone = False
        if gone:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.1)


def serve(path: str) -> None:
    # What the errors chapter's scripts import, torch._dynamo included (DDP imports it).
    import torch
    import torch._dynamo
    import torch.distributed
    import torch.distributed.nn
    import torch.multiprocessing
    import torch.nn.parallel  # noqa: F401

    # Children are reaped by the kernel; each watcher sets the default back for its own.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(16)
        print("ready", flush=True)
        while True:
            connection, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            while not message.endswith(b"\n"):
                message += connection.recv(1 << 20)
            if os.fork() == 0:
                server.close()
                try:
                    watch(connection, json.loads(message), fds)
                finally:
                    os._exit(0)
            connection.close()
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    mode, socket_path, *rest = sys.argv[1:]
    if mode == "serve":
        serve(socket_path)
    elif mode == "worker":
        sys.exit(worker(socket_path, rest))
    else:
        sys.exit(run(socket_path, rest))
