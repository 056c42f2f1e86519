"""How often the answer checker (``bicc.data.checking``) agrees with labelled data.

- ``labelled_completions.jsonl``: 800 Qwen2.5-Math completions on MATH test problems (labels from the
  Qwen evaluation grader) and 2,200 GSM8K model solutions (labels as shipped). Each completion is
  scored with its dataset's extractors, as eval.py would, and compared with ``is_correct``.
- ``mathverify_equivalence_cases.jsonl``: math-verify's own test cases (gold, prediction, expected
  verdict), run through the checker's verify path with each case's options.

Every disagreement is printed with its category so that wrong labels can be told from checker errors.
Run: ``.venv/bin/python -m bench.checker_agreement [--data-dir DIR]``. Ends with
``RESULT agreement_math=... target>=0.99``, ``RESULT agreement_gsm8k=... target>=0.98`` and
``RESULT mathverify_cases=... target>=0.95``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EXTRACTORS = {"MATH test": ("boxed", "answer_is"), "GSM8K test": ("gsm8k", "boxed", "answer_is", "last_number")}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main() -> None:
    from bicc.data.answers import extract
    from bicc.data.checking import MathChecker, VerifyPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dir = Path(os.environ.get("BICC_DATA_DIR", ROOT.parent / "shared" / "data"))
    parser.add_argument("--data-dir", type=Path, default=default_dir)
    args = parser.parse_args()
    rows = read_jsonl(args.data_dir / "labelled_completions.jsonl")
    results = {}
    for dataset, extractors in EXTRACTORS.items():
        subset = [r for r in rows if r["dataset"] == dataset]
        checker = MathChecker(extractors=extractors)
        start = time.perf_counter()
        scores = checker.score_many([r["completion"] for r in subset], [r["answer"] for r in subset])
        elapsed = time.perf_counter() - start
        agree = sum(int(s) == int(r["is_correct"]) for s, r in zip(scores, subset))
        results[dataset] = agree / len(subset)
        print(f"{dataset}: {agree}/{len(subset)} agree ({elapsed:.1f}s; {checker.stats}, "
              f"timeouts {checker.pool.timeouts if checker._pool else 0})")
        for s, r in zip(scores, subset):
            if int(s) != int(r["is_correct"]):
                kind = "checker says correct, label says wrong" if s else "checker says wrong, label says correct"
                pred = extract(r["completion"], extractors)
                print(f"  [{kind}] {r['id']}: gold {r['answer']!r}, extracted {pred!r}"
                      + (f", grader extracted {r['extracted_pred']!r}" if "extracted_pred" in r else ""))
        checker.close()

    cases = read_jsonl(args.data_dir / "mathverify_equivalence_cases.jsonl")
    pool = VerifyPool(workers=2, deadline_s=5.0)
    items = []
    for c in cases:
        opts = c["compare_options"]
        pred = c["pred"] if ("$" in c["pred"] or "\\" in c["pred"]) else f"${c['pred']}$"
        items.append((c["gold"], pred, tuple(opts["match_types"]), int(opts.get("precision", 6)),
                      bool(opts.get("allow_set_relation_comp", False)), False))
    start = time.perf_counter()
    verdicts = pool.run(items)
    pool.close()
    ok = sum(int(v) == int(c["expected"]) for v, c in zip(verdicts, cases))
    print(f"math-verify cases: {ok}/{len(cases)} as expected ({time.perf_counter() - start:.1f}s, "
          f"timeouts {pool.timeouts})")
    for v, c in zip(verdicts, cases):
        if int(v) != int(c["expected"]):
            print(f"  [{c['test']}] gold {c['gold']!r} pred {c['pred']!r}: expected {c['expected']}, got {int(v)}")
    print(f"RESULT agreement_math={results['MATH test']:.4f} target>=0.99")
    print(f"RESULT agreement_gsm8k={results['GSM8K test']:.4f} target>=0.98")
    print(f"RESULT mathverify_cases={ok / len(cases):.4f} target>=0.95")


if __name__ == "__main__":
    main()
