"""Soak test: the default configuration trained through repeated SIGKILLs must end bit-identical to an
uninterrupted run.

1. A reference run of ``--steps`` RL steps, never interrupted.
2. The same run again, interrupted at random times (uniform in ``--kill-min``..``--kill-max`` seconds after each
   start) and restarted with ``resume=auto``, until it completes or ``--minutes`` have passed (after which it is
   left to finish). An interruption is SIGKILL, or with ``--term-share`` SIGTERM, a scheduler's preemption: the run
   must then save its step and exit with code 75 within ``--term-s``.
3. Every parameter of the two final checkpoints is compared.

After every kill, no process the killed run started may be left (rollout workers under ``rollout.async_steps``,
their math-verify processes): each run carries a mark of its own in its environment, which every process it starts
inherits, and the soak waits up to ``--orphan-s`` for the marked ones to be gone.

Run: ``.venv/bin/python -m bench.soak [--minutes 30] [--steps 120] [extra Hydra overrides]``
(``rollout.async_steps=2`` soaks the rollout workers).
Ends with ``RESULT soak_divergence=<max |Δparam|> target==0``, ``RESULT soak_orphans=<processes left after a kill>
target==0``, the counts of steps, resumes, SIGKILLs and SIGTERMs, and ``RESULT soak_sigterm_exit_max_s``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from safetensors.torch import load_file

from bench.common import processes_marked

ROOT = Path(__file__).resolve().parents[1]


def command(run_dir: Path, steps: int, save_every: int, extra: list[str], resume: bool) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), f"train.steps={steps}", f"train.save_every={save_every}",
            "train.keep_last=3", "logger.wandb_mode=disabled", "logger.progress=false", "eval.num_problems=20",
            f"hydra.run.dir={run_dir}", *(["resume=auto"] if resume else []), *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to keep killing the second run")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--kill-min", type=float, default=5.0)
    parser.add_argument("--kill-max", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "soak")
    parser.add_argument("--seed", type=int, default=0, help="of the kill times")
    parser.add_argument("--orphan-s", type=float, default=30.0, help="how long a killed run's processes may outlive it")
    parser.add_argument("--term-share", type=float, default=0.5,
                        help="share of the interruptions that are SIGTERM (a scheduler's preemption), the rest SIGKILL")
    parser.add_argument("--term-s", type=float, default=120.0,
                        help="how long a SIGTERMed run may take to save its step and exit (code 75)")
    parser.add_argument("extra", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    reference, soaked = args.out / "reference", args.out / "killed"

    start = time.perf_counter()
    final = Path("checkpoints") / f"step_{args.steps}" / "model.safetensors"
    for run_dir in (reference, soaked):  # a finished run reused must be of this many steps
        if (run_dir / "results.json").exists() and not (run_dir / final).exists():
            raise SystemExit(f"{run_dir} holds a finished run without {final}: another --steps; give a fresh --out")
    if not (reference / "results.json").exists():
        subprocess.run(command(reference, args.steps, args.save_every, args.extra, resume=False), cwd=ROOT, env=env,
                       check=True, stdout=subprocess.DEVNULL)
    ref_s = time.perf_counter() - start
    print(f"reference: {args.steps} steps in {ref_s:.0f}s", flush=True)

    from bicc.machine.preemption import REQUEUE_EXIT

    kills, terms, starts, orphans, term_exit_s = 0, 0, 0, 0, 0.0
    stop_killing = time.perf_counter() + 60 * args.minutes
    log = args.out / "killed.log"
    while not (soaked / "results.json").exists():
        starts += 1
        mark = uuid.uuid4().hex
        with open(log, "w") as err_file:  # a file, not a pipe: a process outliving the run would hold a pipe open
            proc = subprocess.Popen(command(soaked, args.steps, args.save_every, args.extra, resume=starts > 1), cwd=ROOT,
                                    env={**env, "BICC_RUN_MARK": mark}, stdout=subprocess.DEVNULL, stderr=err_file)
        if time.perf_counter() < stop_killing:
            try:
                proc.wait(timeout=rng.uniform(args.kill_min, args.kill_max))
            except subprocess.TimeoutExpired:
                if rng.random() < args.term_share:  # preempted: the run saves its step and exits REQUEUE_EXIT
                    sent = time.perf_counter()
                    os.kill(proc.pid, signal.SIGTERM)
                    try:
                        code = proc.wait(timeout=args.term_s)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(f"run #{starts} did not exit within {args.term_s:g}s of SIGTERM") from None
                    if code not in (REQUEUE_EXIT, 0):  # 0: it had just finished
                        raise RuntimeError(f"run #{starts} exited {code} after SIGTERM:\n{log.read_text()[-3000:]}")
                    terms, term_exit_s = terms + 1, max(term_exit_s, time.perf_counter() - sent)
                    print(f"SIGTERM to run #{starts} after {time.perf_counter() - start:.0f}s: exit {code} in "
                          f"{time.perf_counter() - sent:.1f}s", flush=True)
                    if code == REQUEUE_EXIT:
                        continue
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                kills += 1
                deadline = time.perf_counter() + args.orphan_s
                while processes_marked(mark) and time.perf_counter() < deadline:
                    time.sleep(0.2)
                left = processes_marked(mark)
                orphans += len(left)
                for pid in left:  # counted; not left to disturb the runs after it
                    os.kill(pid, signal.SIGKILL)
                print(f"killed run #{starts} after {time.perf_counter() - start:.0f}s"
                      + (f"; {len(left)} of its processes outlived it by {args.orphan_s:g}s" if left else ""), flush=True)
                continue
        proc.wait()
        err = log.read_text()
        if proc.returncode == REQUEUE_EXIT:  # a SIGTERM that came as it finished its last step
            continue
        if proc.returncode != 0:
            raise RuntimeError(f"run #{starts} failed with exit {proc.returncode}:\n{err[-3000:]}")
    a, b = load_file(reference / final), load_file(soaked / final)
    if a.keys() != b.keys():
        raise RuntimeError("the two final checkpoints hold different parameter names")
    divergence = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    print(f"{time.perf_counter() - start:.0f}s in all; {kills} SIGKILLs, {terms} SIGTERMs, {starts - 1} resumes")
    print(f"RESULT soak_divergence={divergence:g} target==0")
    print(f"RESULT soak_orphans={orphans} target==0")
    print(f"RESULT soak_steps={args.steps}")
    print(f"RESULT soak_resumes={starts - 1}")
    print(f"RESULT soak_kills={kills}")
    print(f"RESULT soak_sigterms={terms}")
    print(f"RESULT soak_sigterm_exit_max_s={term_exit_s:.1f} target<={args.term_s:g}")


if __name__ == "__main__":
    main()
