"""A process that has imported what ``train.py`` and ``eval.py`` import (torch, transformers, Hydra, bicc: about 6 s on
2 cores) and forks a child for each run a test starts (``tests.helpers.run_train``), so that a run pays for its work
and not for its imports again. The child is the script as ``python <script> <args>`` runs it: its own working dir,
environment, argv, ``sys.path`` and stdout/stderr files, the script run as ``__main__``, Python's exit handlers at its
end. Two kinds of process a run has are forked too: a torchrun launch's ranks (``ranks``), and the processes of the
library a run starts, such as its rollout workers (``start_spawner``). What happens at import time of the libraries
is not part of the child: tests/test_host.py starts the entry points as processes for that, and the tests of what
torchrun itself does start torchrun.

Requests and answers are JSON lines on stdin and stdout: ``{"script", "args", "cwd", "env", "stdout", "stderr"}``
(and ``"ranks": n`` for the script's n ranks under torchrun), answered ``{"pid"}`` when the child starts and
``{"returncode"}`` (negative: the signal) when it ends. One run at a time, as a test waits for each.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def preload() -> None:
    sys.path[0] = str(ROOT)
    from bicc.machine.host import cuda_allocator_default

    cuda_allocator_default()  # as train.py does, before torch
    import hydra  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import bicc.config  # noqa: F401
    import bicc.evaluation.evaluate  # noqa: F401
    import bicc.machine.distributed  # noqa: F401
    import bicc.machine.preemption  # noqa: F401
    import bicc.trainer.loop  # noqa: F401
    import bicc.trainer.validation  # noqa: F401


def child(request: dict) -> int:
    """Run the script as its own process would, or as torchrun's ranks would (``ranks``); the exit code."""
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setpgid(0, 0)  # its own group, as a test's process started apart is
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("ranks"):
        return ranks(request["script"], request["args"], request["ranks"])
    return run(request["script"], request["args"])


def run(script: str | None, args: list[str], module: str | None = None) -> int:
    """``python <script> <args>`` (or ``python -m <module> <args>``) in this process, under its environment; the exit
    code. The processes of the library it starts are forked too (``start_spawner``)."""
    import atexit
    import runpy
    import threading
    import traceback

    if "OMP_NUM_THREADS" in os.environ:  # torch sizes its thread pool by it at start
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    first = os.getcwd() if module else str((ROOT / script).parent)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *BASE_PATH]
    sys.argv = [module or str(ROOT / script), *args]
    start_spawner()
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the interpreter's own handling of an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()  # non-daemon threads, as at an interpreter's exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


# ---- A run's own processes of the library (``python -m bicc.<module>``: rollout workers) ---------------------------
# Started as processes they would pay the imports again (a rollout worker: about 5 s). Before its script runs, a run
# forks a clean copy of itself (the spawner) and becomes the subreaper of its descendants; its ``subprocess.Popen``
# then hands ``[sys.executable, "-m", "bicc.<module>", ...]``, given no option but ``env``, to the spawner, which forks
# the process through a middle process that exits at once: the kernel makes it the run's child, which the run waits
# for, signals and reads the exit code of as of one it started. Anything else is started as before.
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
START_VARIABLES = ("PYTHONPATH", "PYTHONUNBUFFERED")  # read at start, and set as a forked process reads them


def prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)


def start_spawner() -> None:
    import signal
    import subprocess

    prctl(PR_SET_CHILD_SUBREAPER, 1)
    run_pid, (asks, ask), (answers, answer) = os.getpid(), os.pipe(), os.pipe()
    if os.fork() == 0:
        os.close(ask)
        os.close(answers)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # it ends with its run
        try:
            if os.getppid() == run_pid:
                spawn(run_pid, asks, answer)
        finally:
            os._exit(0)
    os.close(asks)
    os.close(answer)
    subprocess.Popen = forking_popen(subprocess.Popen, os.fdopen(ask, "w", buffering=1), os.fdopen(answers))


def spawn(run_pid: int, asks: int, answer: int) -> None:
    """The spawner's loop: a request ``{"module", "args", "cwd", "env"}`` a line, answered ``{"pid"}`` once the
    process is the run's child."""
    import time

    with os.fdopen(asks) as requests, os.fdopen(answer, "w", buffering=1) as answers:
        for line in requests:
            request = json.loads(line)
            handoff, handed = os.pipe()
            middle = os.fork()
            if middle == 0:
                middle = os.getpid()
                pid = os.fork()
                if pid == 0:
                    for fd in (handoff, handed, requests.fileno(), answers.fileno()):
                        os.close(fd)
                    while os.getppid() == middle:  # until the kernel hands it to the run
                        time.sleep(0.001)
                    code = 1
                    try:
                        if os.getppid() == run_pid:
                            os.chdir(request["cwd"])
                            os.environ.clear()
                            os.environ.update(request["env"])
                            code = run(None, request["args"], module=request["module"])
                    finally:
                        os._exit(code)
                os.write(handed, str(pid).encode())
                os._exit(0)
            os.close(handed)
            pid = int(os.read(handoff, 32))
            os.close(handoff)
            os.waitpid(middle, 0)  # gone: its child is the run's
            answers.write(json.dumps({"pid": pid}) + "\n")


def forking_popen(popen, ask, answers):
    """``subprocess.Popen``, but ``[sys.executable, "-m", "bicc.<module>" or "tests.<module>", ...]`` with no option
    but ``env`` (whose variables read at start are the server's) forked by the spawner."""
    import threading

    lock = threading.Lock()

    class Popen(popen):
        def __init__(self, args, *rest, **kwargs):
            env = kwargs.get("env")
            env = dict(os.environ if env is None else env)
            forked = (not rest and set(kwargs) <= {"env"} and isinstance(args, (list, tuple)) and len(args) >= 3
                      and args[0] == sys.executable and args[1] == "-m" and str(args[2]).startswith(("bicc.", "tests."))
                      and env.get("BICC_TEST_FORK") != "0"
                      and all(env.get(k) == SERVER_ENV.get(k) for k in {*env, *SERVER_ENV}
                              if k.startswith("PYTHON") and k not in START_VARIABLES))
            if not forked:
                super().__init__(args, *rest, **kwargs)
                return
            with lock:
                ask.write(json.dumps({"module": str(args[2]), "args": [str(a) for a in args[3:]], "cwd": os.getcwd(),
                                      "env": env}) + "\n")
                pid = json.loads(answers.readline())["pid"]
            self._waitpid_lock, self._input, self._communication_started = threading.Lock(), None, False
            self.args, self.stdin, self.stdout, self.stderr, self.pid, self.returncode = args, None, None, None, pid, None
            self.encoding = self.errors = None
            self.pipesize, self.text_mode, self.universal_newlines = -1, False, False
            self._sigint_wait_secs, self._closed_child_pipe_fds, self._child_created = 0.25, True, True

    return Popen


def ranks(script: str, args: list[str], n: int) -> int:
    """``torchrun --standalone --nproc_per_node=<n> <script> <args>`` as its ranks see it: n children of this
    process, each with the variables torchrun gives a rank (rank 0 serves the rendezvous store on a free port) and
    this process's output files. When one fails, the others get SIGTERM, as torchrun's agent sends, and the code is
    torchrun's 1. What torchrun itself does (its agent, restarts, forwarding a signal, its error summary) is not here:
    the tests of those start torchrun."""
    import signal
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
              "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(n),
              "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    if n > 1 and "OMP_NUM_THREADS" not in os.environ:  # torchrun's default for several ranks a node
        shared["OMP_NUM_THREADS"] = "1"
    running = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.environ.update(shared, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            code = 1
            try:
                code = run(script, args)
            finally:
                os._exit(code)
        running[pid] = rank
    code = 0
    while running:
        pid, status = os.wait()
        rank, exit_code = running.pop(pid), os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0:
            print(f"[zygote] rank {rank} exited with code {exit_code}; the others get SIGTERM", file=sys.stderr,
                  flush=True)
            code = 1
            for other in running:
                os.kill(other, signal.SIGTERM)
    return code


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # what the preload prints goes nowhere; the protocol has its own fd
    os.close(null)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            code = 1
            try:
                code = child(request)
            finally:
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    preload()
    BASE_PATH = [p for p in sys.path[1:] if p]
    SERVER_ENV = dict(os.environ)
    serve()
