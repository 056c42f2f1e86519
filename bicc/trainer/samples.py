"""The samples a run keeps for reading (``logger.samples_every``): every N steps, the first ``logger.samples_rows``
rows of that step's batch go to ``samples.jsonl`` in the run dir (and a wandb table): the prompt, the completion,
its reward, correctness and advantage, and under BiCC the context x^c the update read, with the attempts it shows
(their rows in the step) and which of those were cut. Model outputs are untrusted text: every text is cut to
``logger.samples_max_chars`` here, and the viewer escapes what a terminal would act on.

View a run's samples: ``python -m bicc.trainer.samples <run dir> [--step N]`` (the last logged step by default).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FILE = "samples.jsonl"


def cap(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f" [... {len(text) - limit} characters cut]"


def sample_rows(step: int, ro, advantages, contexts, tokenizer, logger_cfg) -> list[dict]:
    """The rows of step ``step`` to keep: the first ``samples_rows`` of the rollout ``ro`` with their advantages
    [N] and, under BiCC, their contexts (``bicc.method.conditioning.ConditionedPrompts``, else None)."""
    limit = logger_cfg.samples_max_chars
    group_size = int((ro.group_ids == ro.group_ids[0]).sum())
    rows = []
    for i in range(min(logger_cfg.samples_rows, len(ro.out.texts))):
        row = {"step": step, "row": i, "group": int(ro.group_ids[i]), "prompt": cap(ro.prompts[i], limit),
               "completion": cap(ro.out.texts[i], limit), "reward": float(ro.rewards[i]), "correct": float(ro.correct[i]),
               "advantage": float(advantages[i]), "finished": bool(ro.out.finished[i]), "weight_version": ro.version}
        if contexts is not None:
            conditioned = bool(contexts.conditioned[i])
            row["conditioned"] = conditioned
            row["context"] = cap(tokenizer.decode(contexts.prompt_ids[i]), limit) if conditioned else None
            # the attempts shown, as the sample index within the group (0 .. G-1), and those cut
            row["attempts"] = [r % group_size for r in contexts.shown[i]] if contexts.shown else []
            row["attempts_cut"] = [r % group_size for r in contexts.cut[i]] if contexts.cut else []
        rows.append(row)
    return rows


def write_samples(run_dir: Path, rows: list[dict], tracker=None) -> None:
    with open(run_dir / FILE, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    if tracker is not None and rows:
        tracker.table("samples", rows, step=rows[0]["step"])


def printable(text) -> str:
    """``text`` with every control character but newline and tab escaped (a model's output may hold terminal
    escape sequences)."""
    text = "" if text is None else str(text)
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)


def show(run_dir: Path, step: int | None = None, out=sys.stdout) -> int:
    """Print step ``step``'s samples (the last step logged when None); returns the step shown."""
    path = Path(run_dir) / FILE
    if not path.exists():
        raise SystemExit(f"{path}: no samples (logger.samples_every is 0, or the run logged none yet)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    steps = sorted({r["step"] for r in rows})
    step = steps[-1] if step is None else step
    chosen = [r for r in rows if r["step"] == step]
    if not chosen:
        raise SystemExit(f"{path}: no samples at step {step}; steps with samples: {steps}")
    for r in chosen:
        head = (f"=== step {r['step']}, row {r['row']} (group {r['group']}): reward {r['reward']:g}, correct "
                f"{r['correct']:g}, advantage {r['advantage']:+.3f}, weight version {r['weight_version']}")
        print(head, file=out)
        print(f"--- prompt\n{printable(r['prompt'])}", file=out)
        if r.get("conditioned"):
            cut = f", cut: {r['attempts_cut']}" if r["attempts_cut"] else ""
            print(f"--- context x^c (attempts {r['attempts']} of this group{cut})\n{printable(r['context'])}", file=out)
        print(f"--- completion\n{printable(r['completion'])}", file=out)
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Print a run's logged samples (samples.jsonl) for reading.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None, help="the step to show (default: the last logged)")
    args = parser.parse_args(argv)
    show(args.run_dir, args.step)


if __name__ == "__main__":
    main()
