"""A process that has imported what ``train.py`` and ``eval.py`` import (torch, transformers, Hydra, bicc: about 6 s on
2 cores) and forks a child for each run a test starts (``tests.helpers.run_train``), so that a run pays for its work
and not for its imports again. The child is the script as ``python <script> <args>`` runs it: its own working dir,
environment, argv, ``sys.path`` and stdout/stderr files, the script run as ``__main__``, Python's exit handlers at its
end. What happens at import time of the libraries is not part of the child: tests/test_host.py starts the entry
points as processes for that.

Requests and answers are JSON lines on stdin and stdout: ``{"script", "args", "cwd", "env", "stdout", "stderr"}``,
answered ``{"pid"}`` when the child starts and ``{"returncode"}`` (negative: the signal) when it ends. One run at a
time, as a test waits for each.
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
    """Run the script as its own process would; the exit code."""
    import atexit
    import runpy
    import threading
    import traceback

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
    if "OMP_NUM_THREADS" in request["env"]:  # torch sizes its thread pool by it at start
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    script = str(ROOT / request["script"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [str(Path(script).parent), *extra, *BASE_PATH]
    sys.argv = [script, *request["args"]]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
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
    serve()
