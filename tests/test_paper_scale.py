"""What the first paper-scale GPU run needs from the parts (each test failed on the code before the fix):
installable GPU requirements, vLLM engines per torchrun rank from HF ids with a bounded max_model_len and
level-2 sleep, collectives on the process group's device, every end token, and a deduplicated, shuffled
DAPO-Math."""

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bicc.config import RolloutConfig, VllmConfig
from bicc.machine import distributed
from bicc.machine.distributed import Dist
from bicc.rollout import EngineOptions

ROOT = Path(__file__).resolve().parents[1]


def requirement_names(path):
    lines = [line.split("#")[0].strip() for line in (ROOT / path).read_text().splitlines()]
    return {line.split(">")[0].split("=")[0].split("<")[0].strip() for line in lines if line}


def test_gpu_requirements_install_without_flash_attn_and_every_install_has_datasets():
    """flash-attn's build imports torch, so in one file with vLLM `pip install -r` aborted and installed
    nothing; `datasets` loads data=dapo_math17k's HF id and any dataset by id, so the base install has it."""
    gpu = requirement_names("requirements-gpu.txt")
    assert "flash-attn" not in gpu and "vllm" in gpu and "datasets" in requirement_names("requirements.txt")
    assert requirement_names("requirements-flash.txt") == {"flash-attn"}
    assert "--no-build-isolation" in (ROOT / "README.md").read_text()


class FakeLLM:
    """Records how the engine drives vLLM."""

    calls: list = []

    def __init__(self, **kwargs):
        FakeLLM.calls = [("init", kwargs)]

    def __getattr__(self, name):
        return lambda *args, **kwargs: FakeLLM.calls.append((name, kwargs))


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = pytest.importorskip("vllm")
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    return FakeLLM


def hub_model():
    from bicc.config import TinyArchConfig
    from bicc.model.load import build_tiny

    model, tok = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16), 0)
    model.name_or_path = "Qwen/Qwen3-4B-Instruct-2507"  # what the presets' model.path is: an HF id, not a dir
    return model, tok


@pytest.mark.launch
def test_vllm_engine_per_rank_from_an_hf_id(fake_vllm):
    from bicc.rollout import build_engine

    model, tok = hub_model()
    rollout = OmegaConf.structured(RolloutConfig(engine="vllm", vllm=VllmConfig(gpu_memory_utilization=0.4, sleep=True)))
    d = Dist(rank=3, world=4, local_rank=3, strategy="fsdp2", device="cuda:3")
    build_engine("vllm", model, tok, rollout, EngineOptions(end_ids=(2, 7), dist=d, max_model_len=5000, dtype="bfloat16"))
    kwargs = fake_vllm.calls[0][1]
    assert kwargs["model"] == "Qwen/Qwen3-4B-Instruct-2507"
    # each rank's engine on its own GPU, in the trainer's process group (vLLM's default put all on GPU 0)
    assert kwargs["distributed_executor_backend"] == "external_launcher" and kwargs["tensor_parallel_size"] == 1
    # the run's longest sequence, not the model's 262,144 (whose KV does not fit the engine's share)
    assert kwargs["max_model_len"] == 5000 and kwargs["dtype"] == "bfloat16"


def test_engine_args_one_process_and_gpu_sleep():
    from bicc.rollout.engines.vllm import engine_args

    rollout = OmegaConf.structured(RolloutConfig(engine="vllm", vllm=VllmConfig(sleep=True)))
    one = engine_args("m", "bfloat16", rollout, EngineOptions(max_model_len=300), cuda=True)
    assert "distributed_executor_backend" not in one and one["enable_sleep_mode"] and one["max_model_len"] == 300
    rollout.vllm.max_model_len = 4096  # an explicit setting wins over the derived length
    assert engine_args("m", "bfloat16", rollout, EngineOptions(max_model_len=300), cuda=False)["max_model_len"] == 4096


def test_kv_space_is_computed_from_the_model_and_the_rows():
    from types import SimpleNamespace

    from bicc.rollout.engines.vllm import engine_args, kv_cache_bytes, kv_space

    tiny = SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           hidden_size=32, max_position_embeddings=1024)
    # 130 tokens take 2 blocks of 128; a token is K + V x 2 layers x 1 KV head x 16 x 4 bytes = 256; 10 rows x 2
    # blocks + vLLM's null block = 21 blocks x 128 x 256 = 688,128 bytes, + 10% (68,813, rounded up) = 756,941
    assert kv_cache_bytes(tiny, "float32", 10, 130) == 756_941
    assert kv_cache_bytes(tiny, "bfloat16", 10, 130) == 344_064 + 34_407  # 2 bytes a value
    assert kv_cache_bytes(tiny, "float32", 10, 128) == 360_448 + 36_045  # one block a row: 11 blocks
    assert kv_cache_bytes(tiny, "float32", 1000, 130) == kv_cache_bytes(tiny, "float32", 256, 130)  # vLLM runs 256
    # no head_dim / num_key_value_heads: hidden / heads and every head (2 x 2 x 2 x 16 x 4 = 512 a token)
    mha = SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, max_position_embeddings=1024)
    assert kv_cache_bytes(mha, "float32", 10, 130) == 1_376_256 + 137_626
    rollout = OmegaConf.structured(RolloutConfig(engine="vllm"))
    options = EngineOptions(max_model_len=130, rows=10)
    assert kv_space(tiny, "float32", rollout, options, cuda=False) == 756_941
    assert kv_space(tiny, "float32", rollout, options, cuda=True) is None  # gpu_memory_utilization decides
    assert kv_space(tiny, "float32", rollout, EngineOptions(), cuda=False) == kv_cache_bytes(tiny, "float32", 256, 1024)
    rollout.vllm.max_model_len = 300  # the rollout's own setting wins over the derived length: 3 blocks
    assert kv_space(tiny, "float32", rollout, options, cuda=False) == 1_015_808 + 101_581  # 31 blocks
    rollout.vllm.kv_cache_bytes = 12345  # an explicit size wins on either device
    assert kv_space(tiny, "float32", rollout, options, cuda=False) == kv_space(tiny, "float32", rollout, options, True) == 12345
    assert engine_args("m", "float32", rollout, options, cuda=False, kv_bytes=12345)["kv_cache_memory_bytes"] == 12345
    # the rows a call holds: a prompt shard's samples (16 queries over 4 shards x G 8 = 32) or an evaluation call
    from bicc.rollout import engine_rows

    rollout.prompts_per_step, rollout.group_size = 16, 8
    assert engine_rows(rollout, OmegaConf.create({"batch_size": 8}), shards=4) == 32
    assert engine_rows(rollout, OmegaConf.create({"batch_size": 8})) == 128
    assert engine_rows(rollout, OmegaConf.create({"batch_size": 200}), shards=4) == 200
    assert "kv_cache_memory_bytes" not in engine_args("m", "float32", rollout, options, cuda=True)


def test_a_runs_vllm_engine_on_cpu_gets_the_kv_space_of_its_own_rows(fake_vllm, tmp_path):
    """``build_rl_state`` sizes vLLM's CPU KV space by the run's rows: a prompt shard's samples (16 queries over 2
    shards x G 4 = 32) or an evaluation call (eval.batch_size 24), whichever is more, at the run's longest
    sequence; not vLLM's 256 rows."""
    from bicc.config import TinyArchConfig
    from bicc.model.load import build_tiny
    from bicc.rollout.engines.vllm import kv_cache_bytes
    from bicc.trainer.state import build_rl_state
    from tests.conftest import compose_cfg

    model, tok = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16), 0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "rollout=vllm", "rollout.prompts_per_step=16", "rollout.group_size=4",
                       "rollout.shards=2", "eval.batch_size=24"])
    build_rl_state(cfg, str(tmp_path), str(tmp_path), torch.device("cpu"), max_model_len=300)
    kwargs = fake_vllm.calls[0][1]
    assert kwargs["kv_cache_memory_bytes"] == kv_cache_bytes(model.config, "float32", 32, 300)
    cfg.eval.batch_size = 40
    build_rl_state(cfg, str(tmp_path), str(tmp_path), torch.device("cpu"), max_model_len=300)
    assert fake_vllm.calls[0][1]["kv_cache_memory_bytes"] == kv_cache_bytes(model.config, "float32", 40, 300)


def test_vllm_sleeps_at_level_2_and_wakes_weights_before_the_sync(fake_vllm):
    """Level 1 copies the 8 GB of weights to host and back each step although the sync overwrites them."""
    from bicc.rollout import build_engine

    model, tok = hub_model()
    engine = build_engine("vllm", model, tok, OmegaConf.structured(RolloutConfig(engine="vllm", vllm=VllmConfig(sleep=True))),
                          EngineOptions(dtype="bfloat16"))
    engine.sleep_enabled = True  # as on a GPU
    engine.sleep()
    engine.update_weights(model, 1)
    names = [(name, kwargs.get("level", kwargs.get("tags"))) for name, kwargs in fake_vllm.calls[1:]]
    assert names == [("sleep", 2), ("wake_up", ["weights"]), ("collective_rpc", None), ("wake_up", ["kv_cache"]),
                     ("reset_prefix_cache", None)]
    pushed = dict(fake_vllm.calls[3][1]["kwargs"]["weights_iterator"])
    assert all(t.dtype == torch.bfloat16 for t in pushed.values())  # the engine's dtype, not the fp32 master


class Stop(Exception):
    pass


@pytest.mark.parametrize("helper", ["totals", "sum_value", "micro_batches"])
def test_collectives_take_tensors_on_the_groups_device(monkeypatch, helper):
    """NCCL has no CPU path: a CPU tensor reduced on an NCCL group crashes the first update. The step's collectives
    (``Ranks``) put their tensors on ``Dist.device``; a stand-in group checks it (a meta device plays the GPU)."""
    from bicc.machine import ranks
    seen = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise Stop

    monkeypatch.setattr(ranks.collective, "all_reduce", all_reduce)
    monkeypatch.setattr(ranks, "is_sharded", lambda model: True)
    d = Dist(rank=0, world=2, strategy="fsdp2", device="meta")
    from bicc.method.losses import StepTotals

    on = ranks.Ranks(d)
    call = {"totals": lambda: on.totals(StepTotals(3.0, 1.0, 8.0)), "sum_value": lambda: on.sum_value(1.0),
            "micro_batches": lambda: on.micro_batches([torch.arange(2)], None)}[helper]
    with pytest.raises(Stop):
        call()
    assert seen == [torch.device("meta")]


def test_dist_device_follows_the_backend(monkeypatch):
    """NCCL: collectives on cuda:<LOCAL_RANK>, an explicit timeout (torch's 10-minute default killed jobs whose
    ranks waited out another's evaluation), and Python objects gathered over a gloo group of their own."""
    from bicc.config import DistConfig

    made = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, timeout: made.update(init=(backend, timeout)))
    monkeypatch.setattr(distributed.dist, "new_group", lambda backend, timeout: made.update(group=(backend, timeout)) or "cpu")
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 5)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 8)
    cfg = OmegaConf.structured(DistConfig(backend="nccl", timeout_minutes=90))
    d = distributed.init(cfg)
    assert (d.rank, d.local_rank, d.device, d.cpu_group) == (5, 1, "cuda:1", "cpu")  # RANK over all nodes, LOCAL_RANK here
    assert made == {"init": ("nccl", timedelta(minutes=90)), "group": ("gloo", timedelta(minutes=90))}
    made.clear()
    d = distributed.init(OmegaConf.structured(DistConfig(backend="gloo")))
    assert d.device == "cpu" and d.cpu_group is None and made == {"init": ("gloo", timedelta(minutes=60))}
    # torchrun with one process joins a group of one too (the code 4 GPUs run); no torchrun, no group
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 1)
    made.clear()
    d = distributed.init(cfg)
    assert d.enabled and d.world == 1 and made["init"] == ("nccl", timedelta(minutes=90))
    monkeypatch.delenv("LOCAL_RANK")
    assert not distributed.init(cfg).enabled


def test_every_end_token_stops_and_is_stripped(monkeypatch):
    """Phi-4-mini's generation config lists <|end|> and <|endoftext|>: stopping on the tokenizer's EOS alone
    ran outputs past <|end|> and showed it inside BiCC contexts."""
    from bicc.config import BiccConfig
    from bicc.method.conditioning import build_contexts
    from bicc.model.load import end_token_ids
    from bicc.rollout import SamplingParams, build_engine

    model, tok = hub_model()
    other_end = tok.pad_token_id  # stands for <|endoftext|>: a second end token
    model.generation_config.eos_token_id = [tok.eos_token_id, other_end]
    ends = end_token_ids(tok, model)
    assert ends == [tok.eos_token_id, other_end]
    engine = build_engine("hf", model, tok, OmegaConf.structured(RolloutConfig(engine="hf")),
                          EngineOptions(end_ids=tuple(ends)))
    seen = {}

    def generate(input_ids, **kwargs):  # the model "writes" 3 tokens, the second end token, then more
        seen.update(kwargs)
        tail = torch.tensor([[40, 41, 42, other_end, 43]] * input_ids.shape[0])
        return torch.cat([input_ids.cpu(), tail], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    out = engine.generate([[5, 6, 7]], SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0))
    assert seen["eos_token_id"] == ends
    assert out.completion_ids == [[40, 41, 42, other_end]] and out.finished == [True]

    cfg = OmegaConf.structured(BiccConfig(enabled=True, max_tokens=64, min_attempt_tokens=1))
    ids = [[40, 41, other_end], [50, 51, 52, tok.eos_token_id]]
    ctx = build_contexts(["p", "p"], ids, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), tok, cfg, 64,
                         [[1], [1]], ends)
    assert other_end not in ctx.prompt_ids[1][-8:] and [40, 41] == [t for t in ctx.prompt_ids[1] if t in (40, 41)]


def dapo_rows(n_problems, copies):
    rows = []
    for i in range(n_problems):
        for c in range(copies):
            rows.append({"prompt": [{"role": "user", "content": f"Problem {i}. Answer: $Answer"}],
                         "reward_model": {"ground_truth": str(i)}, "extra_info": {"index": f"id-{c}"}})
    return rows


def test_dapo_math_is_deduplicated_and_shuffled_by_seed(tmp_path):
    """The HF copy holds each prompt ~100 times with repeated ids: the duplicate-id check stopped the run,
    and rows were read in file order."""
    from bicc.config import DataConfig, MathDataConfig
    from bicc.data import build_task

    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in dapo_rows(30, 4)))
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps({"problem": "1+1", "answer": "2", "id": "t"}) + "\n")

    def task(seed):
        math = MathDataConfig(train_source=str(path), test_source=str(test), problem_field="prompt.0.content",
                              answer_field="reward_model.ground_truth", id_field="extra_info.index", dedupe=True,
                              shuffle=True, instruction="")
        return build_task(OmegaConf.structured(DataConfig(task="math", seed=seed, math=math)))

    a, b, c = task(0), task(0), task(1)
    problems = [a.train_problem(i).prompt for i in range(30)]
    assert sorted(problems) == sorted(f"Problem {i}. Answer: $Answer" for i in range(30))  # each once
    assert problems == [b.train_problem(i).prompt for i in range(30)]  # a function of the seed
    assert problems != [c.train_problem(i).prompt for i in range(30)]
    assert problems != sorted(problems, key=lambda p: int(p.split()[1].rstrip(".")))  # not file order
    second = [a.train_problem(i).prompt for i in range(30, 60)]  # the next epoch: every row, in an order of its own
    assert sorted(second) == sorted(problems) and second != problems


def test_evaluation_deals_problem_sample_rows_evenly():
    """AIME (30 problems) x n = 32 over 4 ranks: chunks of 16 problems dealt rank k mod W gave ranks 2-3 nothing,
    and they sat in a collective while ranks 0-1 decoded ~2M tokens each until the NCCL watchdog killed the job.
    The 960 (problem, sample) rows now go 240 to each shard, every row exactly once, in calls of <= 64 rows."""
    from bicc.evaluation.evaluate import EvalCall, plan_calls

    plan = plan_calls(30, 32, 64, 4)
    rows = [[(c.first + i, c.sample + j) for c in calls for i in range(c.problems) for j in range(c.n)] for calls in plan]
    assert [len(r) for r in rows] == [240] * 4
    assert sorted(x for r in rows for x in r) == [(p, j) for p in range(30) for j in range(32)]
    assert all(c.problems * c.n <= 64 for calls in plan for c in calls)
    # by hand: 5 problems x 4 samples, calls of <= 8 rows, 3 shards of rows 0-5, 6-12, 13-19
    assert plan_calls(5, 4, 8, 3) == [[EvalCall(0, 1, 0, 4), EvalCall(1, 1, 0, 2)],
                                      [EvalCall(1, 1, 2, 2), EvalCall(2, 1, 0, 4), EvalCall(3, 1, 0, 1)],
                                      [EvalCall(3, 1, 1, 3), EvalCall(4, 1, 0, 4)]]
    # one shard: whole problems per call, as many as fit; more samples than a call holds: a problem split
    assert plan_calls(5, 4, 8, 1) == [[EvalCall(0, 2, 0, 4), EvalCall(2, 2, 0, 4), EvalCall(4, 1, 0, 4)]]
    assert plan_calls(1, 32, 12, 1) == [[EvalCall(0, 1, 0, 12), EvalCall(0, 1, 12, 12), EvalCall(0, 1, 24, 8)]]
    # a call's seed follows its place in the grid, not the shard that makes it
    assert EvalCall(3, 1, 1, 3).seed(5) == 5 * 1_000_003 + 3 + 1_000_033


def test_evaluation_batches_are_sized_by_tokens():
    """eval=paper under HF generate: 512 rows x 4,096 new tokens ran out of memory at 4B; eval.batch_tokens caps
    rows x (longest prompt + new tokens)."""
    from types import SimpleNamespace

    from bicc.evaluation.evaluate import rows_per_call

    cfg = SimpleNamespace(batch_size=512, batch_tokens=131_072, max_new_tokens=4096)
    assert rows_per_call(cfg, 300) == 131_072 // 4396 == 29
    assert rows_per_call(SimpleNamespace(batch_size=512, batch_tokens=0, max_new_tokens=4096), 300) == 512
    assert rows_per_call(SimpleNamespace(batch_size=512, batch_tokens=1000, max_new_tokens=4096), 300) == 1
