"""bench/mechanism.py's bookkeeping on synthetic run dirs: the lr row's sigma_bar, the pairing by seed, the
sequential variance rule and the report (no training here)."""

import json

import pytest

from bench import mechanism as m
from bench.common import run_dir_of


def fake_run(out, name, seed, start, end, problems, accuracy_by_step, extra=None):
    d = run_dir_of(out, name, seed)
    (d / "eval" / "arith").mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({
        "initial": {"eval/pass@1": start, "eval/greedy_acc": start},
        "final": {"eval/pass@1": end, "eval/greedy_acc": end, "eval/pass@1_ci95": 0.1}}))
    rows = [{"step": s, "reward/accuracy": a, **(extra(s) if extra else {})} for s, a in accuracy_by_step.items()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval" / "arith" / "per_problem.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "accuracy": a}) + "\n" for i, a in enumerate(problems)))
    (d / "wall_s.txt").write_text("600\n")
    return d


def test_lr_row_waits_for_sigma_bar_then_divides_the_task_lr(tmp_path):
    assert m.overrides_of(m.LR_ROW, tmp_path) is None  # BiCC-GRPO+RCC seed 0 not run yet
    # steps 1-5 of the full method's seed 0: sigma 0.4, 0.4, 0.5, 0.5, 0.45 -> 0.45; step 6 is not read
    sigmas = {1: 0.4, 2: 0.4, 3: 0.5, 4: 0.5, 5: 0.45, 6: 0.01}
    fake_run(tmp_path, m.FULL, 0, 0.4, 0.3, [0.5], {s: 0.2 for s in sigmas},
             extra=lambda s: {"train/reward_std_mixed": sigmas[s]})
    assert m.sigma_bar(tmp_path) == pytest.approx(0.45)
    assert m.overrides_of(m.LR_ROW, tmp_path)[-1] == f"optim.lr={1e-5 / 0.45:.3g}"  # the preset's lr 1e-5
    assert m.overrides_of("BiCC-GRPO+RCC std", tmp_path) == [m.TASK, "bicc=on", "rcc=std"]


def test_paired_uses_common_seeds_only(tmp_path):
    # base seeds 0, 1; row seed 1 only: the row's 0.9 against base seed 1's 0.5 on both problems -> +40 points
    base = {0: fake_run(tmp_path, "GRPO", 0, 0.3, 0.1, [0.1, 0.1], {1: 0.1}),
            1: fake_run(tmp_path, "GRPO", 1, 0.3, 0.5, [0.5, 0.5], {1: 0.1})}
    row = {1: fake_run(tmp_path, "BiCC-GRPO", 1, 0.3, 0.9, [0.9, 0.9], {1: 0.1})}
    mean, lo, hi, seeds = m.paired(base, row)
    assert (mean, lo, hi, seeds) == (pytest.approx(40.0), pytest.approx(40.0), pytest.approx(40.0), 1)
    assert m.paired(base, {}) is None


@pytest.mark.parametrize(("ratios", "stop"), [
    ([0.6, 1.2, 0.7, 1.1], False),  # 0.90 ± 0.46: the interval holds both 1.0 and 0.75 -> another block
    ([0.9, 1.1, 0.95, 1.05], True),  # 1.00 ± 0.14: holds 1.0, excludes 0.75 -> settled
    ([0.5, 0.52, 0.48, 0.5], True),  # well below 0.75 -> settled
    ([0.5, 0.52, 0.48], False),  # settled in value but mid-block: the block is finished first
    ([1.0] * 23 + [0.5], False),  # 24 batches end it ...
])
def test_variance_rule_stops_on_an_interval_that_excludes_one_of_the_two(ratios, stop):
    values = [{"rcc_q": [r, 1.0], "baseline": [1.0, 1.0], "rcc_xc": [r, 1.0], "mean_centered": [1.0, 1.0]} for r in ratios]
    assert m.settled(values) is (stop or len(values) >= m.MAX_BATCHES)


def test_report_pairs_rows_and_writes_the_figure(tmp_path):
    out, docs = tmp_path / "runs", tmp_path / "docs"
    steps = {s: 0.2 + 0.01 * s for s in range(1, 21)}
    for seed in (0, 1):
        fake_run(out, "GRPO", seed, 0.4, 0.8, [0.8, 0.8, 0.8], steps)
        fake_run(out, "BiCC-GRPO", seed, 0.4, 0.7, [0.7, 0.7, 0.7], steps)
        fake_run(out, m.FULL, seed, 0.4, 0.3, [0.3, 0.3, 0.3], {s: 0.2 for s in range(1, 21)},
                 extra=lambda s: {"rcc/cov": 0.1, "train/adv_abs_mean": 0.3, "train/reward_std_mixed": 0.4})
    m.report(out, docs, 3, 1.0)
    text = (docs / "mechanism.md").read_text()
    full_row = next(line for line in text.splitlines() if line.startswith(f"| {m.FULL} |"))
    # against GRPO -50 points, against BiCC-GRPO -40 (every problem, both seeds): intervals of one point each
    assert "-50.0 [-50.0, -50.0] (2 seeds; below 0)" in full_row and "-40.0 [-40.0, -40.0] (2 seeds; below 0)" in full_row
    assert "6 of " in text and (docs / "mechanism.png").stat().st_size > 10_000


def test_prune_keeps_the_record_and_the_variance_checkpoints_only(tmp_path):
    d = fake_run(tmp_path, "GRPO", 0, 0.4, 0.8, [0.8], {1: 0.2})
    (d / "commit.txt").write_text("abc1234\n")
    for junk in ("stdout.log", ".hydra/config.yaml", "eval/arith/samples.jsonl", "samples/step_1.jsonl",
                 "checkpoints/step_20/model.safetensors"):
        (d / junk).parent.mkdir(parents=True, exist_ok=True)
        (d / junk).write_text("x")
    m.prune(d, keep_checkpoints=True)
    assert (d / "checkpoints/step_20/model.safetensors").exists()
    m.prune(d)
    kept = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert kept == ["commit.txt", "eval/arith/per_problem.jsonl", "metrics.jsonl", "results.json", "wall_s.txt"]
    assert sorted(p.name for p in d.iterdir()) == ["commit.txt", "eval", "metrics.jsonl", "results.json", "wall_s.txt"]


def test_provenance_names_the_commits_and_refuses_uncommitted_code(tmp_path):
    from bench.common import code_commit

    head = code_commit().removesuffix("+changes")
    runs = [fake_run(tmp_path, "GRPO", s, 0.4, 0.8, [0.8], {1: 0.2}) for s in (0, 1)]
    for d in runs:
        (d / "commit.txt").write_text(head + "\n")
    assert m.provenance(runs) == f"Runs at commit {head}."
    (runs[1] / "commit.txt").write_text(head + "+changes\n")
    assert "differs between them" in m.provenance(runs) and f"{head}+changes" in m.provenance(runs)
    assert m.provenance([tmp_path / "none"]) == "No runs yet."


def test_a_variance_checkpoint_is_trained_again_only_when_its_record_has_none(tmp_path, monkeypatch):
    calls = []

    def fake_run_one(name, overrides, seed, steps, threads, out_root, extra):
        calls.append((name, overrides, seed, steps, out_root))
        return run_dir_of(out_root, name, seed)

    monkeypatch.setattr(m, "run_one", fake_run_one)
    monkeypatch.setattr(m, "SCRATCH", tmp_path / "scratch")
    d = fake_run(tmp_path, m.FULL, 0, 0.4, 0.5, [0.5], {1: 0.2})
    # the record has no checkpoint (it is not committed): the row is trained again, into SCRATCH, saving step 20
    assert m.checkpoint(tmp_path, m.FULL, 2) == run_dir_of(tmp_path / "scratch", m.FULL, 0) / "checkpoints" / "step_20"
    (name, overrides, seed, steps, out_root), = calls
    assert (name, seed, steps, out_root) == (m.FULL, 0, m.STEPS, tmp_path / "scratch")
    assert overrides == [m.TASK, "bicc=on", "rcc=on", "train.save_every=20", "train.keep_last=0"]
    # a record that kept its checkpoint is used as it is
    (d / "checkpoints" / "step_20").mkdir(parents=True)
    assert m.checkpoint(tmp_path, m.FULL, 2) == d / "checkpoints" / "step_20" and len(calls) == 1


def test_code_commit_marks_uncommitted_training_code(tmp_path, monkeypatch):
    import subprocess

    import bench.common as common

    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path,  # noqa: E731
                                    check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "bicc").mkdir()
    (tmp_path / "bicc" / "loss.py").write_text("A = 1\n")
    (tmp_path / "notes.md").write_text("x\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "notes.md").write_text("y\n")  # not training code: the run is still the commit's
    assert common.code_commit() == head
    (tmp_path / "bicc" / "loss.py").write_text("A = 2\n")
    assert common.code_commit() == head + "+changes"
    assert not common.same_training_code([head + "+changes"])  # one commit, but not a committed one
    git("commit", "-qam", "two")
    assert not common.same_training_code([head, git("rev-parse", "--short", "HEAD")])
    (tmp_path / "notes.md").write_text("z\n")
    git("commit", "-qam", "three: docs only")
    assert common.same_training_code([git("rev-parse", "--short", "HEAD~1"), git("rev-parse", "--short", "HEAD")])


def test_seed_one_runs_before_the_variance_and_the_horizon():
    order = m.jobs(3)
    assert order[:len(m.ROWS)] == [(name, 0, m.STEPS) for name in m.ROWS]
    variance, first_horizon = order.index(("variance", 0, 0)), order.index(("BiCC-GRPO 60-step", 0, m.HORIZON_STEPS))
    assert max(order.index((name, 1, m.STEPS)) for name in m.ROWS) < variance < first_horizon
    assert all(order.index((name, 2, m.STEPS)) > first_horizon for name in m.ROWS)
    assert len(order) == 3 * len(m.ROWS) + 2 + 1 + 4  # rows x seeds, the headline's two, the variance, the horizon


def test_only_keeps_the_grids_order_and_names_an_unknown_row():
    horizon = m.jobs(3, ["BiCC-GRPO+RCC 60-step", "BiCC-GRPO 60-step"])
    assert horizon == [(name, s, m.HORIZON_STEPS) for s in m.HORIZON_SEEDS for name in m.HORIZON]
    assert m.jobs(3, ["GRPO"]) == [("GRPO", s, m.STEPS) for s in range(3)]
    with pytest.raises(SystemExit, match="GRPO 60-step"):
        m.jobs(3, ["GRPO 60-step"])
