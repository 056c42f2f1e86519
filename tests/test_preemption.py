"""Preemption around the run (bicc/machine/preemption.py): what the processes a run starts for itself do with the
scheduler's signals. The run's own handling of a signal (finish the step, save it, exit 75): tests/test_resume.py."""

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

# A process that lets the signals pass, as a rollout or math-verify worker does: it survives SIGTERM and SIGUSR1
# sent to itself, and what it starts by exec (a subprocess, a spawned multiprocessing worker) or by fork has the
# default dispositions: a SIGTERM ends each, so a reward's ``with Pool(...)`` or ``p.terminate(); p.wait()`` returns.
LETS_PASS = textwrap.dedent("""
    import multiprocessing as mp, os, signal, subprocess, sys, time
    from bicc.machine.preemption import ignore_preemption

    def square(x):
        return x * x

    if __name__ == "__main__":
        ignore_preemption()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(0.5)
        child.terminate()
        print("exec child", child.wait(timeout=20))
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(pid, signal.SIGTERM)
        print("fork child", os.waitpid(pid, 0)[1])
        for method in ("spawn", "fork"):
            with mp.get_context(method).Pool(1) as pool:
                result = pool.map_async(time.sleep, [60])  # a worker busy when the pool's exit terminates it
                time.sleep(1.0 if method == "fork" else 5.0)
            print(method, "pool ended")
        print("alive")
""")


@pytest.mark.launch
def test_a_process_that_lets_the_signals_pass_starts_children_that_take_them(tmp_path):
    script = tmp_path / "lets_pass.py"
    script.write_text(LETS_PASS)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "exec child -15" and lines[1] == "fork child 15", lines  # ended by SIGTERM, each
    assert lines[2:] == ["spawn pool ended", "fork pool ended", "alive"]
