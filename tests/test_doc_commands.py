"""Every command the docs/ pages list in their code blocks runs (the README's: ``tests/test_readme_commands.py``):
each is started here with its smallest settings, or names the test that already starts it at miniature size (each
behaviour launched once), or says what it needs that this machine lacks and which test holds its parts. A command
added to a page without a row here fails."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

NAMED = re.compile(r"tests/(test_\w+)\.py(?:::(\w+))?")
STEP = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=16", "sft.steps=5",
        "eval.num_problems=2", "logger.progress=false"]
# a docs command (its words up to the first placeholder or option that varies) -> how it is started
COMMANDS = {
    "torchrun --nnodes=2": "tests/test_distributed.py::test_two_nodes_match_one_process_and_resume",
    "torchrun --nproc_per_node=2 train.py experiment=paper_qwen3_4b algo=dapo bicc=on rcc=on rollout.async_steps=1":
        "tests/test_paper_rehearsal.py::test_two_training_ranks_and_two_vllm_workers",
    "make gpu-check": "needs a CUDA GPU; without one it says so: "
                      "tests/test_gpu_check.py::test_without_a_gpu_it_says_so_and_exits_nonzero_at_once",
    "python -m bench.update_vs_bare --fsdp --compile --shape qwen3_4b_width --layers 36":
        "tests/test_update_vs_bare.py::test_the_bench_runs_ours_under_fsdp2_and_prints_its_results_and_top_ops",
    "python -m bench.update_vs_bare --fsdp --compile --shape qwen3_4b_width --layers fit":
        "tests/test_update_vs_bare.py::test_layers_fit_runs_ours_alone_at_the_depth_and_checkpointing_the_memory_model_chose",
    "python -m bench.memory_model": ["-m", "bench.memory_model"],
    "python -m bench.memory_tracker": "tests/test_memory_tracker.py",
    "python -m bench.step_profile": ["-m", "bench.step_profile", "--warmup", "0", "--steps", "1", *STEP],
    "python -m bench.update_vs_bare": "tests/test_update_vs_bare.py",
    "python -m bench.peer_trl": "needs TRL (requirements-bench.txt, not in make test's env); its parts: "
                                "tests/test_bench_entry.py::test_peer_trl_runs_trl_in_colocate_mode_only_beside_our_vllm_rollouts",
    "python -m bench.async_overlap": "tests/test_async.py (the workers against the synchronous step, run for run)",
    "python -m bench.weight_sync": "tests/test_bench_entry.py::test_the_push_bench_measures_both_hand_offs",
    "python -m bench.step_model --layouts": ["-m", "bench.step_model", "--layouts"],
    "make setup-smollm2": "tests/test_smollm2.py (the wheel; pytest -m slow)",
    "python -m bicc.rollout.worker --connect":
        "tests/test_distributed.py::test_a_rollout_worker_started_elsewhere_draws_what_one_started_here_does",
    "python -m bicc.trainer.samples": "tests/test_readme_commands.py (the README's command)",
    "python -m bicc.evaluation.plots": "tests/test_readme_commands.py (the README's command)",
    "python -m bicc.evaluation.compare": "tests/test_eval_compare.py",
    "python eval.py": "tests/test_readme_commands.py (the README's eval.py ckpt=...); compare: tests/test_eval_compare.py",
    "python -m bicc.trainer.probe": "the probe on the tiny model: tests/test_readme_commands.py",
    "torchrun --nproc_per_node=": "tests/test_distributed.py (2 ranks under FSDP2 and DDP against one process; 1 rank: "
                                  "tests/test_distributed.py::test_one_process_under_torchrun_is_the_multi_process_code)",
    "torchrun --nnodes=": "tests/test_distributed.py::test_two_nodes_match_one_process_and_resume",
    "sbatch docs/slurm/": "needs Slurm; its torchrun line and resources: tests/test_slurm.py",
    "python train.py experiment=sweep_paper_main": "tests/test_experiments.py (the sweep's grid with one more variant)",
    "python train.py experiment=paper_qwen3_4b_lora": "needs a CUDA GPU and Qwen3-4B; its memory prediction: "
        "tests/test_lora.py::test_the_lora_preset_is_predicted_to_fit_one_80_gib_gpu_and_full_fine_tuning_is_not; "
        "a LoRA run resumed after SIGKILL: tests/test_resume.py::test_sigkill_then_resume_is_bit_identical_with_lora_adapters",
    "python -m bench.lora": "needs make setup-smollm2 (SmolLM2-135M); LoRA's parts: tests/test_lora.py",
    ".venv/bin/python -m bench.lora_learns": ["-m", "bench.lora_learns", "--report-only"],  # the study's table, from its records
    "python -m bicc.model.lora": "tests/test_lora.py::test_a_checkpoint_holds_the_adapters_and_loads_back_to_the_same_policy",
    "python train.py hydra.searchpath=": "tests/test_extending.py (a loss and its YAML outside the library)",
    ".venv/bin/python -m tests.presets": "tests/test_layout.py::test_every_preset_resolves_as_recorded (its record)",
    "make train": "the main job (6-7 min): tests/test_train_smoke.py starts train.py on the same default, shrunk",
    "make test": "CI's command (.ci/run; make test-heavy after it); make test-fast and make lint: the Makefile's own lines",
    "make lint": "CI's command (.ci/run)",
    "make results": ["-m", "bench.results", "--steps", "1", "--seeds", "1", "--configs", "GRPO", "--ratios", "",
                     "--no-readme", "--out", "{tmp}/results", "diag.every=0", *STEP],
    "python -m bench.soak": "tests/test_resume.py (SIGKILL then resume, bit-identical: the soak's one cycle)",
    ".venv/bin/python train.py experiment=smollm2_arith":
        "needs make setup-smollm2: "
        "tests/test_smollm2.py::test_two_rl_steps_of_the_paper_method_on_vllm_and_the_checkpoint_reads_back_bare",
    ".venv/bin/python -m bicc.trainer.probe": "the probe on the tiny model: tests/test_readme_commands.py",
}


COMMAND = re.compile(r"(\.venv/bin/)?python |torchrun |make [a-z]|sbatch |bash ")


def doc_commands() -> list[tuple[str, str]]:
    """(page, command) for every command of docs/*.md (history aside): each line of a code block (continuation
    lines joined, comments cut) and each code span in the text that starts like one."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = " ".join(line.split("#")[0].split())
                if COMMAND.match(command):
                    found.append((page.name, command))
        for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            command = " ".join(span.split())
            if COMMAND.match(command):
                found.append((page.name, command))
    return found


def test_every_docs_command_has_a_smoke_run():
    commands = doc_commands()
    assert len(commands) >= 15
    for page, command in commands:
        assert any(command.startswith(key) for key in COMMANDS), f"docs/{page}: command without a smoke run: {command}"
    for where in (v for v in COMMANDS.values() if isinstance(v, str)):
        for module, test in NAMED.findall(where):
            text = (ROOT / "tests" / f"{module}.py").read_text(encoding="utf-8")
            assert not test or f"def {test}(" in text, f"{where}: no such test"


@pytest.mark.launch
@pytest.mark.parametrize("key", [k for k, v in COMMANDS.items() if isinstance(v, list)])
def test_each_docs_command_runs(key, tmp_path: Path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WANDB_MODE": "disabled", "BICC_CACHE": str(tmp_path / "c"),
           "PYTHONPATH": str(ROOT)}
    args = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[key]]
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"\S", proc.stdout), "printed nothing"
