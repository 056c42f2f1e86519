"""``bench.hf_generate`` end to end on CPU at a tiny shape: both cache forms run through the HF engine, and the
ratio it prints is the ratio of the rates it prints."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_generate_bench_runs_both_cache_forms_and_prints_their_ratio():
    cmd = [sys.executable, "-m", "bench.hf_generate", "--layers", "1", "--prompts", "2", "--n", "3", "--tokens", "6",
           "--prompt-tokens", "5"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    forms = re.findall(r"^\[hf_generate\] (\w+) cache: (\d+) tokens in ([0-9.]+) s", out, re.M)
    assert [f for f, *_ in forms] == ["growing", "static"]  # the engine's own cache setting, read back
    for _, tokens, _ in forms:
        assert 0 < int(tokens) <= 2 * 3 * 6  # rows x most new tokens
    alike = re.search(r"rows sampled alike by both forms: (\d+) of (\d+)", out)
    assert int(alike.group(2)) == 6 and 0 <= int(alike.group(1)) <= 6
    result = {k: float(v) for k, v in re.findall(r"^RESULT (\w+)=([0-9.]+)", out, re.M)}
    assert set(result) == {"hf_tokens_per_s", "hf_static_tokens_per_s", "hf_static_vs_dynamic"}
    ratio = result["hf_static_tokens_per_s"] / result["hf_tokens_per_s"]
    assert abs(result["hf_static_vs_dynamic"] - ratio) <= 1e-3 * ratio + 1e-3  # the printed rates are rounded
