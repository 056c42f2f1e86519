"""A miniature rehearsal of the headline command

    torchrun --nproc_per_node=4 train.py experiment=paper_qwen3_4b algo=dapo bicc=on rcc=on

on its exact code path: torchrun (2 processes, gloo, started 1.5 s apart, in a working dir of their own and
without ``hydra.run.dir``: the run dir is the one the preset names), FSDP2, the paper preset (its engine,
vLLM, one per rank under the external launcher; bf16 compute over fp32 master weights, activation
checkpointing, KV-reuse packing, DAPO's dynamic sampling, RCC), the DAPO-Math data path (a local file in its
nested layout, deduplicated and shuffled), a sharded initial and final evaluation on the paper's benchmarks
as the repo's ``data/`` ships them (eval.limit), a checkpoint and a resume. Only sizes are shrunk, the model
is a tiny one saved as a local HF dir (a Qwen3 with tied embeddings and a chat template for the Qwen preset; a
Llama over a byte-level BPE, untied, with two end tokens, for the Phi-4-mini preset), and the training reward is
constructed (``tests/rewards.py``: mixed groups and all-wrong ones whatever the model samples). A hang fails the
test (timeout)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

pytestmark = pytest.mark.launch

pytest.importorskip("vllm")

from tests.helpers import CONSTRUCTED_REWARD, ROOT, run_script  # noqa: E402

ARITH = ["data.arith.max_operands=2", "data.arith.max_operand=19", "data.arith.test_size=50",
         "model.tiny.max_position_embeddings=1024"]
WARM = [*ARITH, "eval.num_problems=4", "stage=sft", "sft.steps=100", "sft.batch_size=16", "logger.wandb_mode=disabled",
        "logger.progress=false", "threads=2"]
SHRINK = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=40", "bicc.max_tokens=40",
          "rollout.vllm.gpu_memory_utilization=0.15", "rollout.vllm.enforce_eager=true", "train.micro_batch_size=3",
          "train.save_every=2", "optim.warmup_steps=1", "eval.limit=2", "eval.samples_per_problem=2",
          "eval.max_new_tokens=24", "eval.checker_workers=1", "logger.wandb_mode=disabled", "logger.progress=false",
          "diag.every=0"]


def env(tmp_path, data_file):
    environ = {k: v for k, v in os.environ.items() if k != "BICC_DATA_DIR"}  # the benchmarks as data/ ships them
    return {**environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "BICC_DAPO_MATH": str(data_file)}


def run(cmd, tmp_path, data_file, timeout=900, cwd=ROOT):
    proc = subprocess.run(cmd, cwd=cwd, env=env(tmp_path, data_file), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def warm_start(tmp_path, data_file, extra=()) -> Path:
    proc = run_script("train.py", [*WARM, *extra, f"hydra.run.dir={tmp_path / 'sft'}"], ROOT, env(tmp_path, data_file),
                      timeout=900)  # forked from the tests' server
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return Path(re.search(r"\[sft\] warm start at (\S+)", proc.stdout).group(1))


def dapo_file(tmp_path) -> Path:
    """Arithmetic problems in DAPO-Math-17k's nested layout, each row three times with repeated ids."""
    from bicc.config import ArithConfig, DataConfig
    from bicc.data import build_task

    task = build_task(OmegaConf.structured(DataConfig(task="arith", arith=ArithConfig(max_operands=2, max_operand=19))))
    rows = []
    for i in range(200):
        p = task.train_problem(i)
        rows += [{"prompt": [{"role": "user", "content": p.prompt}], "reward_model": {"ground_truth": p.answer},
                  "extra_info": {"index": i % 50}}] * 3
    path = tmp_path / "dapo_math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, len({r["prompt"][0]["content"] for r in rows})


@pytest.fixture(scope="module")
def qwen_warm_start(tmp_path_factory):
    """The DAPO-Math file and the tiny Qwen3 warm-started on it, shared by the tests of the Qwen preset: (data file,
    distinct prompts, model dir)."""
    tmp = tmp_path_factory.mktemp("warm")
    data_file, distinct = dapo_file(tmp)
    return data_file, distinct, warm_start(tmp, data_file)


def headline(tmp_path, data_file, experiment, model_dir, steps, extra=(), nproc=2) -> tuple[Path, str]:
    """The headline command from a working dir of its own, ranks started 1.5 s apart (``tests/launch_apart.py``),
    no ``hydra.run.dir`` unless ``extra`` names one: (the one run dir it wrote, its stdout)."""
    cwd = tmp_path / "launch"
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "launch_apart.py"), f"experiment={experiment}", "algo=dapo", "bicc=on", "rcc=on",
           f"model.path={model_dir}", *SHRINK, *CONSTRUCTED_REWARD, f"train.steps={steps}", *extra]
    proc = run(cmd, tmp_path, data_file, cwd=cwd)
    named = [Path(e.split("=", 1)[1]) for e in extra if e.startswith("hydra.run.dir=")]
    dirs = named or sorted(p.parent for p in (cwd / "outputs").glob("*/*/*/.hydra"))
    assert len(dirs) == 1, dirs  # every rank wrote into rank 0's run dir
    engine = re.search(r"\[rollout\] (\w+) engine; longest sequence (\d+) tokens", proc.stdout)
    assert engine and engine.group(1) == "vllm", proc.stdout[-2000:]  # the engine the preset selects
    return dirs[0], proc.stdout


def check_run(run_dir: Path, init_dir: Path, steps: int, dtype=torch.bfloat16):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert any(r["train/grad_norm"] > 0 for r in trained), "no gradient: every group was degenerate"
    results = json.loads((run_dir / "results.json").read_text())
    for name in ("math500", "amc23", "aime24", "aime25"):  # the paper's four benchmarks, sharded over 2 ranks
        assert results["final"][f"eval/{name}/num_problems"] == 2
        scored = [json.loads(line) for line in (run_dir / "eval" / name / "per_problem.jsonl").read_text().splitlines()]
        shipped = [json.loads(line) for line in (ROOT / "data" / f"{name}.jsonl").read_text().splitlines()[:2]]
        assert [r["id"] for r in scored] == [r["id"] for r in shipped], scored
    ckpt = run_dir / "checkpoints" / f"step_{steps}"
    weights, init = load_file(ckpt / "model.safetensors"), load_file(init_dir / "model.safetensors")
    assert all(t.dtype == dtype for t in weights.values())  # HF weights in the compute dtype
    assert (ckpt / "optim_dcp").is_dir()  # optimizer shards, and fp32 master weights beside lower compute weights
    assert (ckpt / "master_dcp").is_dir() == (dtype != torch.float32)
    moved = max((weights[k].float() - init[k].float()).abs().max().item() for k in weights)
    assert moved > 0, "the policy did not move"
    return rows, results


def test_headline_command_phi4_mini_shape_with_a_bpe_tokenizer(tmp_path):
    """The Phi-4-mini preset on a random Llama over SmolLM2's byte-level BPE and ChatML template (pad = EOS =
    <|im_end|>, a system turn in every prompt), its head untied and two end tokens (like <|end|> and
    <|endoftext|>): the untied head pushed to vLLM and saved, BiCC's contexts, vLLM's tokenizer and the
    evaluation's prompts on a real tokenizer, every rank the same."""
    from tests.helpers import bpe_tokenizer, tiny_llama

    data_file, _ = dapo_file(tmp_path)
    tokenizer = bpe_tokenizer()
    model_dir = tmp_path / "bpe_model"
    model = tiny_llama(tokenizer, tie=False)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 0]
    assert tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>" != tokenizer.eos_token
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert not json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"]
    run_dir, _ = headline(tmp_path, data_file, "paper_phi4_mini", model_dir, 2)
    rows, _ = check_run(run_dir, model_dir, 2)
    assert all(r["bicc/samples_conditioned_share"] > 0 for r in rows if "train/loss" in r)
    assert "lm_head.weight" in load_file(run_dir / "checkpoints" / "step_2" / "model.safetensors")  # untied


def test_two_training_ranks_and_two_vllm_workers(tmp_path, qwen_warm_start):
    """The README's rollout-worker command at miniature size (``torchrun --nproc_per_node=2 ... rollout.async_steps=1
    rollout.devices=[2,3]``; on CPU two vLLM workers share a core, ``rollout.cpu_workers=2``) on the paper preset's
    DAPO-Math path with algo=dapo bicc=on rcc=on: each rank trains on its prompt shard of what the two workers drew,
    every weight push reaching both, with a checkpoint at step 2 holding the batch the workers had drawn ahead, by the
    weights of step 1 (the preset's synchronous path, in bf16 with fp32 master weights: the Phi-4-mini shape above).
    Then one training process (torchrun, FSDP2 on one rank, both prompt shards) resumed from that checkpoint with two
    workers of its own reads the batch back and trains step 3 as the two ranks did. In fp32: in bf16 (the preset's,
    whose push tests/test_weight_sync.py covers) one Adam step on 1 and 2 ranks already differs. make test-heavy (4
    vLLM engines on one core: 221 s on a 2-core AVX2 EPYC): in make test, tests/test_rollout_vllm.py runs a vLLM worker,
    tests/test_distributed.py workers beside torchrun and tests/test_resume.py the resume of drawn batches."""
    data_file, distinct, model_dir = qwen_warm_start
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"]  # Qwen3's tied head
    workers = ["rollout.async_steps=1", "rollout.cpu_workers=2", "optim.lr=1e-4", "model.dtype=float32",
               "dist.param_dtype=float32"]
    run_dir, stdout = headline(tmp_path, data_file, "paper_qwen3_4b", model_dir, 3, workers)
    assert "[eval] initial policy" in stdout and f"kept {distinct} rows" in stdout  # DAPO-Math deduplicated
    assert re.search(r"vllm on 2 worker\(s\) \(CPU cores \[\d\]; CPU cores \[\d\]\), weights over gloo in float32", stdout)
    assert re.search(r"rollout worker 1 \(CPU cores \[\d\]\): pid", stdout)
    rows, _ = check_run(run_dir, model_dir, 3, torch.float32)
    steps = [r for r in rows if "train/loss" in r]
    assert [r["rollout/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert [r["rollout/weight_version"] for r in steps] == [0.0, 0.0, 1.0]  # batch 2: the weights pushed after step 1
    assert all(r["perf/push_bytes"] == steps[0]["perf/push_bytes"] > 0 for r in steps)  # every step, every weight
    one = tmp_path / "one"
    _, stdout = headline(one, data_file, "paper_qwen3_4b", model_dir, 3,
                         [*workers, "rollout.shards=2", "eval.shards=2", f"resume={run_dir / 'checkpoints' / 'step_2'}",
                          f"hydra.run.dir={one}"], nproc=1)
    assert "at step 2" in stdout and "1 drawn batch(es) read back from the checkpoint" in stdout
    resumed = [r for r in (json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines())
               if "train/loss" in r]
    assert [r["step"] for r in resumed] == [3]
    a, b = steps[2], resumed[0]
    assert (a["reward/mean"], a["rollout/response_len"]) == (b["reward/mean"], b["rollout/response_len"])
    assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5, (a["train/loss"], b["train/loss"])
    ours, theirs = (load_file(d / "checkpoints" / "step_3" / "model.safetensors") for d in (run_dir, one))
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-5
