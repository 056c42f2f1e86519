"""Rollout workers (``rollout.async_steps``): the async run against the synchronous one and against the reference's stale
loop, the version every batch carries, and the clear stop a failing worker gets. The workers are processes, so
these tests are ``launch`` tests (the sync-mode checks at the end start none)."""

import copy
import threading
import time

import pytest
import torch

from bicc.config import StepConfig
from bicc.data import build_task
from bicc.method.reference import stale_loop
from bicc.rollout import EngineOptions
from bicc.rollout.collect import Collection, DataCursor, collect_rollout, step_seed
from bicc.rollout.engines.hf import HFEngine
from bicc.rollout.worker import FAULT_ENV
from bicc.rollout.workers import RolloutWorkers, WorkerFailure, check_staleness, fresh_pending
from bicc.trainer import step as step_module
from bicc.trainer.optim import warmup_cosine
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from tests.conftest import compose_cfg
from tests.helpers import CONSTRUCTED_REWARD, LR, policy_and_reference, sgd

# BiCC + RCC (the paper's) on 4 queries x 4 with the constructed reward (mixed groups whatever is sampled),
# 32-token outputs so that contexts are built; clipping out of reach so that plain SGD's weights are the gradient
ASYNC_CFG = ["bicc=on", "rcc=on", *CONSTRUCTED_REWARD, "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4",
             "rollout.group_size=4", "rollout.max_new_tokens=32", "bicc.min_attempt_tokens=4", "diag.every=0",
             "optim.warmup_steps=0", "optim.clip_grad=1e9"]
STEPS = 3


@pytest.fixture
def one_thread():
    """The workers sample on one core: the trainer's own sampling (the synchronous run, the reference) on one
    thread too, so that both draw the same tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def state(tmp_path, overrides):
    cfg = compose_cfg([*ASYNC_CFG, *overrides])
    s = build_rl_state(cfg, str(tmp_path / "policy"), str(tmp_path / "init"), torch.device("cpu"))
    return s, cfg


def run_steps(s, cfg, tmp_path, monkeypatch, steps=STEPS):
    """``steps`` of ``rl_step``, with the workers when ``rollout.async_steps`` asks; (metrics, rollouts) per step."""
    rollouts = []
    monkeypatch.setattr(step_module, "check_staleness", lambda ro, *a: rollouts.append(ro) or check_staleness(ro, *a))
    if cfg.rollout.async_steps:
        s.workers = RolloutWorkers(cfg, str(tmp_path / "policy"), s.cursor)
        s.workers.start(s.model, s.step)
    try:
        metrics = [rl_step(s, StepConfig.of(cfg))[0] for _ in range(steps)]
    finally:
        if s.workers is not None:
            s.workers.close()
    return metrics, rollouts


@pytest.mark.launch
def test_async_at_lr_0_is_the_synchronous_run(tmp_path, monkeypatch, one_thread):
    """With the weights held still, a batch drawn a step early is the batch the synchronous step draws: the same
    prompts, seeds and tokens; only the staleness differs, and the losses (TIS against the workers' log-probs)."""
    policy_and_reference(tmp_path)
    sync, cfg = state(tmp_path, ["optim.lr=0"])
    m_sync, r_sync = run_steps(sync, cfg, tmp_path, monkeypatch)
    s, cfg_async = state(tmp_path, ["optim.lr=0", "rollout.async_steps=1"])
    m_async, r_async = run_steps(s, cfg_async, tmp_path, monkeypatch)
    assert [r.out.completion_ids for r in r_async] == [r.out.completion_ids for r in r_sync]
    assert [r.prompts for r in r_async] == [r.prompts for r in r_sync]
    assert len({tuple(map(tuple, r.out.completion_ids)) for r in r_sync}) == STEPS  # each step drew its own
    assert [m["rollout/staleness_max"] for m in m_sync] == [0.0] * STEPS
    assert [m["rollout/staleness_max"] for m in m_async] == [0.0, 1.0, 1.0]
    assert [r.version for r in r_async] == [0, 0, 1]
    assert s.engine.version == 0  # the workers sampled; the trainer's own engine waits for an evaluation ...
    from bicc.trainer.loop import eval_engine

    eval_engine(s, cfg_async.rollout, cfg_async.eval)
    assert s.engine.version == STEPS  # ... which gives it the current weights first
    for a, b in zip(m_async, m_sync):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
        assert a["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)  # the workers' log-probs are pi_old's


@pytest.mark.launch
@pytest.mark.parametrize("async_steps", [1, 2])
def test_async_run_is_the_reference_stale_loop(async_steps, tmp_path, monkeypatch, one_thread):
    """Algorithm 1 with batch t drawn by theta_{t-N} (``bicc.method.reference.stale_loop``, one sequence per
    forward), against ``rl_step`` fed by the workers: the same weights after every step. [2]: make test-heavy."""
    tok = policy_and_reference(tmp_path)
    s, cfg = state(tmp_path, [f"rollout.async_steps={async_steps}"])
    sgd(s)
    before, ref_model = copy.deepcopy(s.model), copy.deepcopy(s.ref_model)
    metrics, rollouts = run_steps(s, cfg, tmp_path, monkeypatch)
    assert all(m["bicc/samples_conditioned_share"] > 0 for m in metrics)
    assert [r.version for r in rollouts] == [max(0, t - async_steps) for t in range(STEPS)]

    task, cursor = build_task(cfg.data), DataCursor()
    options = EngineOptions(end_ids=s.end_ids, logprobs=True)

    def sample(t, policy):
        engine = HFEngine(policy, tok, cfg.rollout, options)
        return collect_rollout(engine, tok, task, Collection.of(cfg.algo, cfg.rollout, cfg.data), cursor, step_seed(cfg.seed, t))

    reference = copy.deepcopy(before)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    out = stale_loop(reference, ref_model, optimizer, warmup_cosine(optimizer, 0, 10, 1.0), tok, sample, STEPS,
                     async_steps, StepConfig.of(cfg), task.answer_anchors, s.end_ids)
    assert all(o["advantages"].abs().sum() > 0 for o in out)
    moved = max((p - b).abs().max().item() for p, b in zip(reference.parameters(), before.parameters()))
    assert moved > 1e-3  # the steps moved the weights: the comparison below is not of two no-ops
    for (name, p), q in zip(s.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=5e-6, rtol=1e-4, msg=name)


@pytest.mark.launch
@pytest.mark.parametrize(("fault", "expected"), [
    ("sample:2:exit", "exited with code 3 while sampling step 2"),
    ("sample:2:hang", "while sampling step 2"),
    ("load:1:hang", "(loaded weight version 0 of 1)"),
])
def test_a_failing_worker_stops_the_run_with_its_name(fault, expected, tmp_path, monkeypatch):
    """A worker that exits, hangs in a step or hangs taking new weights: the step raises within the timeout (3 s
    here), naming the worker, its cores and what it was doing, and the worker is gone. [load:1:hang]: make
    test-heavy (a hang's timeout runs in make test at sample:2)."""
    policy_and_reference(tmp_path)
    s, cfg = state(tmp_path, ["rollout.async_steps=1"])
    monkeypatch.setenv(FAULT_ENV, fault)
    s.workers = RolloutWorkers(cfg, str(tmp_path / "policy"), s.cursor)
    s.workers.start(s.model, 0)
    # dist.timeout_minutes, in seconds, once started (starting imports torch). A worker that exits is seen at once,
    # whatever the timeout: a long one there keeps a slow host's sampling from reading as a hang
    timeout = 3 if fault.endswith("hang") else 120
    s.workers.line.timeout = timeout
    procs = list(s.workers.procs)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="rollout worker 0 \\(CPU cores") as err:
        for _ in range(4):
            rl_step(s, StepConfig.of(cfg))
            start = time.monotonic()
    assert expected in str(err.value)
    assert time.monotonic() - start < min(timeout, 3) + 10  # the timeout (an exit: none), one step, stopping the worker
    assert all(p.poll() is not None for p in procs)


# ---- Both modes: the version each batch carries, the seed each step draws with (no process started) -------

def test_every_batch_is_drawn_by_the_weights_of_its_step_and_a_seed_of_its_own(tmp_path, monkeypatch):
    """Synchronous: step t's batch carries version t (the engine was given the weights of every step), and each
    step and prompt shard samples with its own seed. A step that skips the push, or reuses a seed, fails here."""
    policy_and_reference(tmp_path)
    s, cfg = state(tmp_path, ["rollout.shards=2"])
    seeds, generate = [], s.engine.generate
    monkeypatch.setattr(s.engine, "generate",
                        lambda prompts, sampling: seeds.append(sampling.seed) or generate(prompts, sampling))
    metrics, rollouts = run_steps(s, cfg, tmp_path, monkeypatch)
    assert [r.version for r in rollouts] == list(range(STEPS)) and s.engine.version == STEPS
    assert len(seeds) == 2 * STEPS and len(set(seeds)) == len(seeds)


def test_a_batch_older_than_async_steps_never_reaches_the_loss(tmp_path, monkeypatch):
    policy_and_reference(tmp_path)
    s, cfg = state(tmp_path, [])
    monkeypatch.setattr(s.engine, "update_weights", lambda model, version: None)  # a push skipped
    rl_step(s, StepConfig.of(cfg))
    with pytest.raises(WorkerFailure, match="step 1: its batch was sampled by weight version 0, 1 steps old"):
        rl_step(s, StepConfig.of(cfg))
    ro = type("R", (), {"version": 3})()
    assert check_staleness(ro, 5, 2)["rollout/staleness_max"] == 2.0
    with pytest.raises(WorkerFailure):
        check_staleness(ro, 6, 2)


def test_a_resume_with_fewer_async_steps_draws_the_too_old_batches_again():
    """Batches 5 and 6 drawn by versions 4 and 4 (async_steps 2): a resume at async_steps 1 keeps batch 5 and
    draws 6 again from the data position it started at."""
    entry = lambda step, version, before, after: {  # noqa: E731
        "step": step, "shards": {0: {"version": version}},
        "cursors": {"before": {"pos": before, "shard_pos": []}, "after": {"pos": after, "shard_pos": []}}}
    pending = {"batches": [entry(5, 4, 20, 24), entry(6, 4, 24, 28)], "cursor": {"pos": 28, "shard_pos": []}}
    assert fresh_pending(pending, 2) == pending
    kept = fresh_pending(pending, 1)
    assert [b["step"] for b in kept["batches"]] == [5] and kept["cursor"] == {"pos": 24, "shard_pos": []}
    assert fresh_pending(pending, 0) == {"batches": [], "cursor": {"pos": 20, "shard_pos": []}}


def test_the_workers_devices():
    """CPU: the workers share the cores listed, or the second half of this process's; CUDA: one worker per GPU listed
    (as this process numbers them, mapped through CUDA_VISIBLE_DEVICES), or per GPU after the trainer's ranks; an id out
    of range, listed twice or on a training rank's GPU is refused, naming both."""
    from types import SimpleNamespace

    from bicc.machine.layout import transport, worker_places

    def r(devices=None, cpu_workers=1, remote_workers=0, share_gpus=False):
        return SimpleNamespace(devices=devices, cpu_workers=cpu_workers, remote_workers=remote_workers, share_gpus=share_gpus)

    cpu = lambda cfg: [p.cores for p in worker_places(cfg, 1, False, {}, cores=[0, 1, 2, 3])]  # noqa: E731
    assert cpu(r()) == [(2, 3)] and cpu(r([1])) == [(1,)]
    assert cpu(r([1, 2, 3], cpu_workers=2)) == [(1, 3), (2,)] and cpu(r([1], cpu_workers=2)) == [(1,), (1,)]
    assert cpu(r(remote_workers=2)) == []  # every worker elsewhere
    with pytest.raises(ValueError, match=r"rollout.devices: cores \[7\] are not among"):
        cpu(r([7]))
    gpus = lambda cfg, env, world=2: [p.visible for p in worker_places(cfg, world, True, env, device_count=4)]  # noqa: E731
    assert gpus(r(), {"LOCAL_WORLD_SIZE": "3"}) == ["3"]
    assert gpus(r([2, 3]), {"LOCAL_WORLD_SIZE": "2"}) == ["2", "3"]
    assert gpus(r([2, 3]), {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == ["6", "7"]  # physical ids
    with pytest.raises(ValueError, match=r"GPU 4 is out of range: this process sees 4 GPU\(s\) \(CUDA_VISIBLE_DEVICES=4,5,6,7\)"):
        gpus(r([4]), {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    with pytest.raises(ValueError, match=r"GPU 1 \(physical 5\) is training rank 1's GPU \(cuda:1\)"):
        gpus(r([1, 3]), {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    with pytest.raises(ValueError, match="GPU 3 is listed 2 times"):
        gpus(r([3, 3]), {"LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="no GPU is left for rollout workers"):
        gpus(r(), {"LOCAL_WORLD_SIZE": "4"}, world=4)
    from bicc.rollout import ENGINES

    hf, vllm = ENGINES.get("hf").weight_route, ENGINES.get("vllm").weight_route  # each engine's way between GPUs
    shared = worker_places(r([0], share_gpus=True), 1, True, {}, device_count=1)
    assert [p.shares for p in shared] == [True] and transport(hf, True, shared) == "gloo"  # NCCL: one rank per GPU
    on_own = worker_places(r([1]), 1, True, {}, device_count=2)
    assert transport(hf, True, on_own) == "nccl" and transport(vllm, True, on_own) == "vllm"
    assert transport(vllm, False, worker_places(r(), 1, False, {}, cores=[0, 1])) == "gloo"


def test_each_shard_keeps_the_data_position_of_the_worker_that_draws_it():
    from bicc.rollout.workers import merge_cursors

    specs = [{"shards": [0, 2]}, {"shards": [1, 3]}]
    a = {"before": {"pos": 0, "shard_pos": [4, 0, 4, 0]}, "after": {"pos": 0, "shard_pos": [8, 0, 8, 0]}}
    b = {"before": {"pos": 0, "shard_pos": [0, 4, 0, 4]}, "after": {"pos": 0, "shard_pos": [0, 9, 0, 8]}}
    merged = merge_cursors([a, b], specs)
    assert merged["before"]["shard_pos"] == [4, 4, 4, 4] and merged["after"]["shard_pos"] == [8, 9, 8, 8]


@pytest.mark.launch
@pytest.mark.parametrize(("moment", "fault"), [("kill-start", ""), ("kill-start", "sample:0:hang"), ("kill-push", "")])
def test_no_process_of_the_run_outlives_its_killed_trainer(moment, fault, tmp_path):
    """SIGKILL leaves the trainer no clean-up: killed while its worker draws and returns the first batches
    (``kill-start``), while the worker is stuck in something that never looks at its trainer (a planted hang), or in
    the middle of a weight push while the worker receives it (``kill-push``), on the math task, whose checker starts
    processes of its own in the worker. Every process the run started (each carries the run's mark in its
    environment) is gone within 15 s. The hang and ``kill-push``: make test-heavy."""
    import os
    import subprocess
    import sys
    import uuid

    from bench.common import processes_marked
    from tests.helpers import ROOT
    from tests.scripted_engine import problems_file

    policy_and_reference(tmp_path)
    problems_file(tmp_path / "train.jsonl", 16)
    mark = uuid.uuid4().hex
    math = ["data=jsonl", f"data.math.train_source={tmp_path / 'train.jsonl'}",
            f"data.math.test_source={tmp_path / 'train.jsonl'}", "rollout.engine=tests.scripted_engine:ScriptedEngine"]
    out = tmp_path / "trainer.out"  # a file, not a pipe: the workers inherit it, and a pipe would wait for them
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "async_trainer.py"), str(tmp_path / "policy"),
                               moment, *math], stdout=f, stderr=subprocess.STDOUT, timeout=300,
                              env={**os.environ, "BICC_RUN_MARK": mark, FAULT_ENV: fault})
    assert proc.returncode == -9, out.read_text()[-4000:]
    # the workers write to the same file, and may write after the trainer's line
    line = next(x for x in reversed(out.read_text().splitlines()) if x.startswith("started"))
    started = [int(p) for p in line.split()[1:]]
    # the worker, and once it has scored a batch (before the second push) its math-verify processes
    assert len(started) >= (1 if moment == "kill-start" else 3), out.read_text()[-2000:]
    deadline = time.monotonic() + 15
    while processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_marked(mark)
    for pid in left:  # not to leak them into the rest of the suite
        os.kill(pid, 9)
    assert not left


@pytest.mark.launch
def test_workers_score_the_papers_data_as_the_synchronous_run(tmp_path, monkeypatch, one_thread):
    """The math task's checker in a worker: answers that only math-verify can decide (it runs in processes of its
    own, started by the worker) score as the synchronous step scores them, each as it must."""
    from tests.scripted_engine import ANSWERS, problems_file, written

    policy_and_reference(tmp_path)
    problems_file(tmp_path / "train.jsonl", 16)
    problems_file(tmp_path / "test.jsonl", 4)
    math = ["data=jsonl", f"data.math.train_source={tmp_path / 'train.jsonl'}",
            f"data.math.test_source={tmp_path / 'test.jsonl'}", "rollout.engine=tests.scripted_engine:ScriptedEngine",
            "data.reward=null", "data.reward_batched=false", "optim.lr=0"]
    sync, cfg = state(tmp_path, math)
    _, r_sync = run_steps(sync, cfg, tmp_path, monkeypatch, steps=2)
    s, cfg_async = state(tmp_path, [*math, "rollout.async_steps=1"])
    _, r_async = run_steps(s, cfg_async, tmp_path, monkeypatch, steps=2)
    for a, b in zip(r_async, r_sync):
        expected = [ANSWERS[written(t)] for t in b.out.texts]
        assert 0 < sum(expected) < len(expected)  # right and wrong answers, each decided by math-verify
        assert b.rewards.tolist() == expected and a.out.texts == b.out.texts
        assert a.rewards.tolist() == expected


def in_small_shm(cmd: list[str], shm_bytes: int) -> list[str]:
    """``cmd`` in a mount namespace of its own whose /dev/shm holds ``shm_bytes`` (a container's is 64 MiB); the
    test is skipped where the host allows no such namespace."""
    import shutil
    import subprocess

    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /dev/shm"]
    if not shutil.which("unshare") or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("no mount namespace on this host (unshare -m)")
    import shlex

    return ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && exec {shlex.join(cmd)}"]


@pytest.mark.launch
def test_a_weight_push_needs_no_host_shared_memory(tmp_path):
    """Under a /dev/shm far smaller than the model (64 KiB for a 90 kB fp32 policy), workers start, take every push and
    train: no push goes through host shared memory."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    policy_and_reference(tmp_path)
    params = sum(p.numel() for p in state(tmp_path, [])[0].model.parameters())
    assert params * 4 > 64 * 1024  # the fp32 model would not fit there
    cmd = in_small_shm([sys.executable, str(ROOT / "tests" / "async_trainer.py"), str(tmp_path / "policy"), "run"],
                       64 * 1024)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "trained 2" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# ---- What a worker does with the processes a reward starts, and a worker that is late at start ------------------
START = ["sft.steps=5", "sft.batch_size=8", "train.steps=1", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "rollout.max_new_tokens=16", "eval.num_problems=2", "eval.samples_per_problem=1", "eval.max_new_tokens=16",
         "logger.progress=false", "data.reward_batched=true", "rollout.async_steps=1", "dist.timeout_minutes=2"]


@pytest.mark.launch
def test_a_reward_that_ends_its_processes_with_sigterm_runs_in_a_worker(tmp_path):
    """A TRL-form reward scored in a ``multiprocessing.Pool`` (its with-block ends it with SIGTERM) and ending a child
    with SIGTERM: the worker lets the scheduler's signals pass, but what it starts takes them, so the reward's check
    at the worker's start and every step's scoring return."""
    from tests.helpers import run_train

    run_train([*START, "data.reward=tests.rewards:pooled_parity", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert (tmp_path / "run" / "checkpoints" / "step_1" / "COMPLETE").exists()


@pytest.mark.launch
def test_a_worker_not_ready_in_time_stops_the_run_naming_it_and_where(tmp_path):
    """A worker stuck in the reward's check at its start: the run stops after rollout.worker_start_minutes (12 s
    here), naming the worker and what it was doing, with its stacks printed first."""
    from tests.helpers import run_train

    start = time.monotonic()
    proc = run_train([*START, "data.reward=tests.rewards:stalls_in_worker", "rollout.worker_start_minutes=0.2",
                      f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "WorkerFailure: no answer from rollout worker 0 (CPU cores" in out, out[-3000:]
    assert "while building the task (data.reward's check on a sample)" in out
    assert "within 12 s (rollout.worker_start_minutes) while the workers start" in out
    assert "is late: its stacks follow" in out and 'in stalls_in_worker' in out  # the worker's own stack
    assert time.monotonic() - start < 120


@pytest.mark.launch
def test_a_signal_while_the_workers_start_stops_the_run_at_once(tmp_path):
    """SIGTERM to the trainer while its worker is still starting (here the worker sends it, then hangs): nothing is
    trained to save, so the run stops at once with the preemption's exit code, naming the worker and where it was,
    instead of waiting for it (dist.timeout_minutes, 60)."""
    from bicc.machine.preemption import REQUEUE_EXIT
    from tests.helpers import run_train

    start = time.monotonic()
    proc = run_train([*START, "data.reward=tests.rewards:signals_trainer_in_worker",
                      f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == REQUEUE_EXIT, out[-3000:]
    assert "preempted (SIGTERM" in out and "while the workers start (rollout worker 0 (CPU cores" in out
    assert "building the task (data.reward's check on a sample)" in out
    assert time.monotonic() - start < 90


def test_a_worker_from_elsewhere_that_never_beats_after_its_hello_is_failed(monkeypatch):
    """A worker on another node says hello and dies before its first heartbeat: it is failed once its heartbeat has
    lapsed, counted from the hello (1 s here), not after dist.timeout_minutes."""
    from bicc.rollout import channel, line

    monkeypatch.setattr(line, "HEARTBEAT_LAPSE_S", 1.0)
    trainer = line.Line(timeout_s=20)
    trainer.store = channel.serve(0, 20)
    trainer._add(0, "rollout worker 0 (joining from elsewhere)", None)
    channel.from_worker(trainer.store, 0).send("hello", pid=7, host="node1", connect="node0:1", device="cuda")
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rollout worker 0 \(cuda on node1\) said hello \d+ s ago and has not beaten"):
        trainer.wait(lambda: False, "sampling step 0")
    assert time.monotonic() - start < 10


@pytest.mark.launch
def test_a_worker_whose_trainer_died_before_it_asked_to_die_with_it_ends_at_once():
    """The kernel ends a worker with its trainer only from the moment the worker asks (prctl); a trainer that died
    before that leaves the worker re-parented: it sees another parent than the pid it was given and ends, instead of
    waiting for a store that will never answer (600 s)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "bicc.rollout.worker", "--connect", "127.0.0.1:9", "--index", "0",
                           "--parent-pid", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert time.monotonic() - start < 20


class BlocksUntilAborted:
    """A weight group whose broadcast waits as an NCCL collective does when a peer has died: until the group is
    aborted (then it raises, as NCCL's aborted communicator does). 60 s at most, so that a test of code that never
    aborts it fails instead of hanging."""

    def __init__(self, group):
        self.aborted, self.group = threading.Event(), group  # the real group kept open: its peer stays in it

    def broadcast(self, tensors, options):
        return self

    def wait(self):
        if not self.aborted.wait(60):
            raise AssertionError("the blocked broadcast was never aborted")
        raise RuntimeError("NCCL communicator was aborted")

    def abort(self):
        self.aborted.set()


@pytest.mark.launch
def test_a_worker_that_dies_in_a_push_whose_collective_blocks_stops_the_run_naming_it(tmp_path):
    """The push's collective cannot see a worker that died (NCCL's broadcast waits for ever): the worker is SIGKILLed
    while the trainer is blocked in it, and the push stops within seconds with an error naming the worker and the
    version, the communicator aborted and the worker gone."""
    import os
    import signal

    policy_and_reference(tmp_path)
    s, cfg = state(tmp_path, ["rollout.async_steps=1"])
    s.workers = RolloutWorkers(cfg, str(tmp_path / "policy"), s.cursor)
    s.workers.start(s.model, 0)
    blocked = s.workers.group = BlocksUntilAborted(s.workers.group)
    (proc,) = s.workers.procs
    threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rollout worker 0 \(CPU cores \[\d+\]\) exited with code -9 while sending "
                                            r"weight version 1: the transfer was aborted \(RuntimeError: NCCL"):
        s.workers.push(s.model, 1)
    assert blocked.aborted.is_set() and time.monotonic() - start < 10
    assert proc.poll() is not None and s.workers.line.links == []
