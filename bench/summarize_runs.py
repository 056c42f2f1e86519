"""Markdown table of run dirs' evaluations: ``.venv/bin/python -m bench.summarize_runs RUN_DIR [RUN_DIR ...]``.

Reads each run's results.json (initial and final sampled pass@1 with 95% CI, greedy accuracy) and
metrics.jsonl (steps, wall time of the RL stage)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(run: Path) -> str:
    results = json.loads((run / "results.json").read_text(encoding="utf-8"))
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    rl_seconds = sum(s.get("perf/step_s", 0.0) for s in steps)
    initial, final = results["initial"], results["final"]
    config = run / "config.json"
    name = json.loads(config.read_text(encoding="utf-8"))["run_name"] if config.exists() else run.name
    return (f"| {name} | {100 * initial['eval/pass@1']:.1f} | {100 * final['eval/pass@1']:.1f} ± "
            f"{100 * final['eval/pass@1_ci95']:.1f} | {100 * (final['eval/pass@1'] - initial['eval/pass@1']):+.1f} | "
            f"{100 * initial['eval/greedy_acc']:.1f} → {100 * final['eval/greedy_acc']:.1f} | {results['steps']} | "
            f"{rl_seconds / 60:.1f} |")


def main(runs: list[str]) -> None:
    print("| run | SFT pass@1 | final pass@1 (95% CI) | Δ | greedy | steps | RL minutes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        print(row(Path(run)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run dirs (each with results.json and metrics.jsonl)")
    main(parser.parse_args().runs)
