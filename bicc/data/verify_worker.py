"""One math-verify worker of ``bicc.data.checking.VerifyPool``: a process of its own, started as

    python -m bicc.data.verify_worker <fd> <parent pid> <memory bytes>

and serving ``verify`` calls over the connection on ``fd`` until it reads ``None`` or the connection closes.

It imports the checker and math-verify, nothing of the process that started it (a multiprocessing spawn would import
that one's ``__main__``: ``train.py``, torch and its CUDA libraries, seconds of imports and gigabytes of mappings), and
before anything else has the kernel end it with that process. A worker started just before its trainer was killed
ends within a moment, not after its imports (which took over 15 s beside a loaded trainer on 2 cores).
"""

from __future__ import annotations

import os
import sys


def verify(gold: str, pred: str, match_types: tuple[str, ...], precision: int, set_rel: bool,
           gold_is_latex: bool) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    from bicc.data.checking import _CODE_LIKE

    if _CODE_LIKE.search(pred):  # checked by the caller too; the expression parser below ends in eval
        return False
    configs = {"latex": LatexExtractionConfig(), "expr": ExprExtractionConfig()}
    gold_cfg = [configs[m] for m in match_types] if not gold_is_latex else [LatexExtractionConfig(), ExprExtractionConfig()]
    pred_cfg = [configs[m] for m in match_types]
    g = parse(gold, extraction_config=gold_cfg, parsing_timeout=None)
    p = parse(pred, extraction_config=pred_cfg, parsing_timeout=None)
    if not g or not p:
        return False
    return bool(verify(g, p, float_rounding=precision, allow_set_relation_comp=set_rel, timeout_seconds=None))


def mapped_bytes() -> int:
    """This process's address space now (VmSize), 0 where ``/proc`` is absent."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def serve(conn, memory_bytes: int) -> None:
    """Answer ``verify`` calls on ``conn``. ``memory_bytes`` is headroom over what this process maps when its loop
    starts: a pathological expression fails with MemoryError instead of taking the machine."""
    import logging
    import resource
    import warnings

    if memory_bytes > 0:
        limit = mapped_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.CRITICAL)  # math-verify warns on every disabled timeout
    warnings.filterwarnings("ignore")
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        try:
            result = verify(*item)
        except Exception:  # a parse/compare failure of untrusted text is a wrong answer, not a crash
            result = False
        conn.send(result)


def main(argv: list[str]) -> int:
    fd, parent, memory_bytes = (int(a) for a in argv)
    from bicc.machine.host import die_with_parent

    if die_with_parent() and os.getppid() != parent:
        return 0  # the process it serves ended before the kernel was asked to end this one with it
    from multiprocessing.connection import Connection

    from bicc.machine.preemption import ignore_preemption

    ignore_preemption()  # the run it serves decides what SIGTERM / SIGUSR1 mean
    serve(Connection(fd), memory_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
