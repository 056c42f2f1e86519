"""python -m bicc.evaluation.compare (and its alias eval.py compare): paired statistics and outputs from two scored dirs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[1]


def fake_result(path: Path, acc: list[float], n: int = 4):
    (path / "bench").mkdir(parents=True)
    with open(path / "bench" / "per_problem.jsonl", "w") as f:
        for i, a in enumerate(acc):
            f.write(json.dumps({"id": f"p{i}", "answer": "1", "n": n, "correct": int(a * n), "accuracy": a}) + "\n")
    mean = float(np.mean(acc))
    summary = {"eval/bench/pass@1": mean, "eval/bench/pass@1_ci_low": mean - 0.05, "eval/bench/pass@1_ci_high": mean + 0.05,
               "eval/bench/pass@2": min(1.0, mean + 0.1), "eval/bench/pass@4": min(1.0, mean + 0.15)}
    (path / "summary.json").write_text(json.dumps(summary))


@pytest.mark.parametrize("command", [["-m", "bicc.evaluation.compare"], ["eval.py", "compare"]])
def test_compare_reports_wilcoxon_and_bootstrap(tmp_path, command):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 5, 40) / 4
    b = np.clip(a + rng.choice([0, 0.25, 0.5], 40), 0, 1)
    fake_result(tmp_path / "A", a.tolist())
    fake_result(tmp_path / "B", b.tolist())
    proc = subprocess.run([sys.executable, *command, str(tmp_path / "A"), str(tmp_path / "B")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "B" / "compare.json").read_text())["bench"]
    assert report["problems"] == 40
    assert abs(report["diff"] - (b - a).mean()) < 1e-12
    assert report["ci"][0] <= report["diff"] <= report["ci"][1]
    expected = stats.wilcoxon(b, a)
    assert abs(report["p"] - expected.pvalue) < 1e-12 and report["wilcoxon_w"] == expected.statistic
    table = (tmp_path / "B" / "compare.md").read_text()
    assert "| bench | 40 |" in table and "↑" in table
    assert (tmp_path / "B" / "passk.png").stat().st_size > 1000


def test_compare_needs_scored_dirs(tmp_path):
    (tmp_path / "A").mkdir()
    proc = subprocess.run([sys.executable, "eval.py", "compare", str(tmp_path / "A"), str(tmp_path / "A")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no summary.json" in proc.stderr
