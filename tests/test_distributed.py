"""torchrun with 2 CPU processes (gloo): FSDP2 and DDP give the update of one process on the same global
batch, and a checkpoint written by 2 processes resumes in 1. torchrun itself launches the runs where what it does
is part of the test (the fixture's FSDP2 run as a user starts it, a signal it forwards, two nodes); the others' ranks
are forked from the tests' server (tests/zygote.py), past the imports each rank would pay again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import MIXED_RUN, ROOT, run_script

pytestmark = pytest.mark.launch

# DAPO's dynamic sampling with one sampling round: each shard keeps only its informative groups. Under the
# constructed reward (tests/rewards.py) shard 0 keeps 4 of its 6 groups at both steps and shard 1 keeps 3, then
# 5, so the two ranks hold different numbers of rows; micro-batches of 3 rows make several forwards per rank.
# Every run here is one of these: under FSDP2 every forward and backward is a collective, and ranks with fewer
# micro-batches used to leave the others waiting for ever (a timeout, 600 s, fails the test).
DAPO = ["algo=dapo", "algo.max_sampling_rounds=1", "rollout.prompts_per_step=12", "seed=1", "train.micro_batch_size=3"]
RUN = [*MIXED_RUN, *DAPO]


def env(tmp_path):
    return {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}


def run(cmd, tmp_path, cwd=ROOT):
    proc = subprocess.run(cmd, cwd=cwd, env=env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def one_process(args, tmp_path):
    proc = run_script("train.py", [*RUN, *args], ROOT, env(tmp_path), timeout=600)  # forked from the tests' server
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def two_processes(args, tmp_path, script="train.py", cwd=ROOT, torchrun=False):
    """``torchrun --standalone --nproc_per_node=2 <script> <RUN> <args>``: its two ranks forked from the tests' server
    (tests/zygote.py), or under ``torchrun`` itself."""
    if torchrun:
        return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                    *RUN, *args], tmp_path, cwd)
    proc = run_script(str(script), [*RUN, *args], cwd, env(tmp_path), timeout=600, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def weights(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    out = {"single": tmp / "single", "ddp": tmp / "ddp"}
    one_process([f"hydra.run.dir={out['single']}"], tmp)  # builds the warm start the others reuse
    # FSDP2 as a user launches it: no hydra.run.dir (the run dir names the launch time), ranks started 1.5 s apart
    # (tests/launch_apart.py), in a working dir of its own
    cwd = tmp / "launch"
    cwd.mkdir()
    two_processes(["dist.strategy=fsdp2"], tmp, script=ROOT / "tests" / "launch_apart.py", cwd=cwd, torchrun=True)
    out["fsdp2_dirs"] = sorted(p.parent for p in (cwd / "outputs").glob("*/*/*/.hydra"))
    out["fsdp2"] = out["fsdp2_dirs"][0]
    two_processes([f"hydra.run.dir={out['ddp']}", "dist.strategy=ddp"], tmp)
    return tmp, out


@pytest.mark.parametrize("options", ["defaults", "once-a-step"])
def test_fsdp2_with_dynamic_sampling_and_uneven_ranks_matches_one_process(runs, options):
    """The ranks hold different numbers of rows (``DAPO``), under FSDP2's default options (the fixture's run, also
    held to one process by ``test_two_processes_match_one``) or [once-a-step] (make test-heavy; tests/test_update.py
    holds these options to the hand loop in make test) its options that gather and reduce once a step."""
    tmp, out = runs
    single, multi = out["single"], out["fsdp2"]
    rows = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    groups = [r["rollout/groups"] for r in rows if "rollout/groups" in r]
    assert groups == [3.5, 4.5], f"ranks' mean group counts {groups}: expected (4 + 3) / 2 and (4 + 5) / 2"
    held = [(multi, 1e-5)]
    if options == "once-a-step":
        # reducing the gradients and freeing the gathered weights once per optimizer step: in the prompts' prefix
        # backward (KV reuse), the empty micro-batches' no-op backwards before it; or, one row per output, in the last
        # micro-batch's backward (weights kept past that would be stale at the next step)
        once, rows_once = tmp / "dapo_fsdp2_once", tmp / "dapo_fsdp2_once_rows"
        keep = ["dist.reduce_grads=step", "dist.reshard_after_backward=false"]
        two_processes([f"hydra.run.dir={once}", "dist.strategy=fsdp2", *keep, "dist.reshard_after_forward=false"], tmp)
        two_processes([f"hydra.run.dir={rows_once}", "dist.strategy=fsdp2", *keep,
                       "train.share_prompts=false", "train.context_packing=false"], tmp)
        # one row per output is other arithmetic than the single process's shared prompts (each row's own prompt
        # forward): after two Adam steps at lr 3e-4 its weights sat 1.03e-5 from them on an AVX2 EPYC (within 1e-5 on
        # AVX-512 Xeons), so it is held to a tenth of one Adam step there (3e-5); its losses stay held to 1e-5
        held += [(once, 1e-5), (rows_once, 3e-5)]
    for run_dir, tol in held:
        a, b = losses(single), losses(run_dir)
        assert len(a) == len(b) == 2 and all(abs(x - y) <= 1e-5 for x, y in zip(a, b)), (run_dir.name, a, b)
        assert max_diff(weights(single, 2), weights(run_dir, 2)) <= tol, run_dir.name


def test_fsdp2_at_another_split_matches_one_process(runs):
    """Split invariance across the layout: 2 FSDP2 ranks at one row a micro-batch (each rank its own count of them,
    DAPO's uneven rows) give the weights of one process at 3 rows a micro-batch (tests/test_split_invariance.py:
    every split in one process, length-aware cuts included)."""
    tmp, out = runs
    run_dir = tmp / "fsdp2_one_row_each"
    two_processes([f"hydra.run.dir={run_dir}", "dist.strategy=fsdp2", "train.micro_batch_size=1"], tmp)
    a, b = losses(out["single"]), losses(run_dir)
    assert len(a) == len(b) == 2 and all(abs(x - y) <= 1e-5 for x, y in zip(a, b)), (a, b)
    assert max_diff(weights(out["single"], 2), weights(run_dir, 2)) <= 1e-5


def test_the_update_is_not_trivial(runs):
    _, out = runs
    rows = [json.loads(line) for line in (out["single"] / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert all(0 < r["reward/accuracy"] < 1 for r in steps)  # mixed groups by construction (tests/rewards.py)
    assert any(r["train/grad_norm"] > 1e-3 for r in steps)
    init = load_file(Path(json.loads((out["single"] / "results.json").read_text())["init_path"]) / "model.safetensors")
    assert max_diff(weights(out["single"], 2), init) > 1e-4  # 10x the tolerance below


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_processes_match_one(runs, strategy):
    _, out = runs
    single, multi = losses(out["single"]), losses(out[strategy])
    assert len(single) == len(multi) == 2
    assert all(abs(a - b) <= 1e-5 for a, b in zip(single, multi)), (single, multi)
    for step in (1, 2):
        assert max_diff(weights(out["single"], step), weights(out[strategy], step)) <= 1e-5
    if strategy == "fsdp2":  # its HF sampler is a copy the weights are pushed to: held to the trainer's log-probs
        rows = [json.loads(line) for line in (out[strategy] / "metrics.jsonl").read_text().splitlines()]
        assert [r["rollout/token_prob_ratio"] < 1 + 1e-4 for r in rows if "train/loss" in r] == [True, True]


def test_fsdp2_checkpoint_is_sharded_and_resumes_in_one_process(runs):
    tmp, out = runs
    ckpt = out["fsdp2"] / "checkpoints" / "step_1"
    assert (ckpt / "optim_dcp").is_dir() and "optimizer" not in torch.load(ckpt / "trainer_state.pt", weights_only=True)
    resumed = tmp / "resumed"
    proc = one_process([f"hydra.run.dir={resumed}", f"resume={ckpt}"], tmp)
    assert "resumed from" in proc.stdout
    assert max_diff(weights(resumed, 2), weights(out["single"], 2)) <= 1e-5


def test_one_process_under_torchrun_is_the_multi_process_code(runs):
    """``torchrun --nproc_per_node=1`` joins a process group of one and wraps the model in FSDP2 as 2 or 4
    processes do (its optimizer checkpoint sharded, the process group's line printed), and computes the plain
    process's update: a one-GPU check covers the code 4 GPUs run."""
    tmp, out = runs
    run_dir = tmp / "torchrun_one"
    proc = run_script("train.py", [*RUN, f"hydra.run.dir={run_dir}", "dist.strategy=fsdp2"], ROOT, env(tmp), timeout=600,
                      ranks=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "[dist] rank 0/1 " in proc.stdout
    assert (run_dir / "checkpoints" / "step_1" / "optim_dcp").is_dir()  # FSDP2's sharded optimizer state
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses(out["single"]), losses(run_dir)))
    assert max_diff(weights(out["single"], 2), weights(run_dir, 2)) <= 1e-5


def test_ddp_checkpoint_resumes_in_two_processes(runs):
    """Resume under torchrun: the DDP step-1 checkpoint (full optimizer state, both shards' data positions)
    continues in 2 processes to the uninterrupted run's step 2."""
    tmp, out = runs
    ckpt = out["ddp"] / "checkpoints" / "step_1"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert "optimizer" in state and not (ckpt / "optim_dcp").exists()
    resumed = tmp / "resumed_ddp"
    proc = two_processes([f"hydra.run.dir={resumed}", "dist.strategy=ddp", f"resume={ckpt}"], tmp)
    assert "resumed from" in proc.stdout
    assert losses(resumed) == losses(out["ddp"])[1:]
    assert max_diff(weights(resumed, 2), weights(out["ddp"], 2)) <= 1e-6


def adapters(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "adapter_model.safetensors")


def test_lora_adapters_under_ddp_and_fsdp2_match_one_process_and_resume_in_one(tmp_path):
    """model.lora over 2 ranks: DDP sums the adapters' gradients alone (the base has none), FSDP2 shards a frozen base
    beside the trained adapters; both end where one process does. FSDP2's checkpoint (the adapters, the optimizer
    sharded) resumes in one process to the uninterrupted run's step 2."""
    lora = ["model.lora.r=4", "model.lora.alpha=8"]
    single, ddp, fsdp2, resumed = (tmp_path / name for name in ("single", "ddp", "fsdp2", "resumed"))
    one_process([*lora, f"hydra.run.dir={single}"], tmp_path)
    two_processes([*lora, f"hydra.run.dir={ddp}", "dist.strategy=ddp"], tmp_path)
    two_processes([*lora, f"hydra.run.dir={fsdp2}", "dist.strategy=fsdp2"], tmp_path)
    trained = adapters(single, 2)  # B starts at zero: it moved 10x the tolerance below
    assert max(v.abs().max().item() for k, v in trained.items() if ".lora_B." in k) > 1e-4
    for multi in (ddp, fsdp2):
        assert all(abs(a - b) <= 1e-5 for a, b in zip(losses(single), losses(multi)))
        for step in (1, 2):
            assert max_diff(adapters(single, step), adapters(multi, step)) <= 1e-5
    ckpt = fsdp2 / "checkpoints" / "step_1"
    assert (ckpt / "optim_dcp").is_dir() and not (ckpt / "model.safetensors").exists()
    proc = one_process([*lora, f"hydra.run.dir={resumed}", f"resume={ckpt}"], tmp_path)
    assert "resumed from" in proc.stdout
    assert max_diff(adapters(resumed, 2), adapters(single, 2)) <= 1e-5


def test_a_signal_to_one_rank_stops_both_after_the_step_and_the_resume_matches(runs):
    """SIGTERM to rank 1 alone, in its first update (as a scheduler may reach one process first): both ranks finish
    step 1 and stop together (the flag is summed over the ranks), rank 0 writing the checkpoint; each rank exits
    REQUEUE_EXIT. Resumed with resume=auto in two processes, step 2 is the uninterrupted DDP run's."""
    from bicc.machine.preemption import REQUEUE_EXIT
    from tests.test_resume import signalled

    tmp, out = runs
    stopped = tmp / "ddp_signalled"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = signalled([*RUN, "dist.strategy=ddp"], stopped, {**env(tmp), "BICC_SIGNAL_RANK": "1"}, "SIGTERM",
                     ["update:1"], 1, launcher)
    assert f"exitcode  : {REQUEUE_EXIT}" in proc.stderr and "[test] SIGTERM sent in update 1" in proc.stdout
    resumed = two_processes([f"hydra.run.dir={stopped}", "dist.strategy=ddp", "resume=auto"], tmp)
    assert "resumed from" in resumed.stdout
    assert losses(stopped) == losses(out["ddp"])
    assert max_diff(weights(stopped, 2), weights(out["ddp"], 2)) <= 1e-6


def test_ranks_started_apart_write_one_run_dir(runs):
    """No hydra.run.dir: the run dir names the launch time. Ranks that start 1.5 s apart must still write into
    one dir, or rank 0 marks a checkpoint complete that holds only its own optimizer shard and resume fails (the
    fixture's FSDP2 run; ``test_fsdp2_checkpoint_is_sharded_and_resumes_in_one_process`` resumes it).
    And when train.py returns, no FSDP module is left alive: the model sits in reference cycles (module <-> hooks),
    and if only interpreter exit frees it, that is after destroy_process_group, where gloo's teardown now and then
    aborts a finished run (SIGABRT, "terminate called without an active exception", exit code -6)."""
    tmp, out = runs
    assert len(out["fsdp2_dirs"]) == 1, out["fsdp2_dirs"]
    assert [(tmp / "launch" / f"alive_rank{r}.txt").read_text() for r in (0, 1)] == ["0", "0"]
    for step in (1, 2):
        shards = sorted(f.name for f in (out["fsdp2"] / "checkpoints" / f"step_{step}" / "optim_dcp").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_nodes(args, tmp_path) -> list[str]:
    """Two torchrun agents of one process each, as two nodes would run them (RANK 1 has LOCAL_RANK 0)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "train.py",
                               *RUN, *args], cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:] + err[-4000:]
        outs.append(out)
    return outs


@pytest.mark.slow
def test_two_nodes_match_one_process_and_resume(runs):
    """`torchrun --nnodes=2`: placement by LOCAL_RANK, prompt shards by RANK, sharded evaluation, rank 0
    writing the HF weights while both ranks write DCP optimizer shards, and a two-node resume (slow: the one-node
    launches above run the same code, where RANK and LOCAL_RANK agree)."""
    tmp, out = runs
    multi = tmp / "two_nodes"
    outs = two_nodes([f"hydra.run.dir={multi}", "dist.strategy=fsdp2"], tmp)
    assert "[dist] rank 1/2 (local rank 0)" in outs[1] and "[dist] rank 0/2 (local rank 0)" in outs[0]
    a, b = losses(out["single"]), losses(multi)
    assert len(b) == 2 and all(abs(x - y) <= 1e-5 for x, y in zip(a, b)), (a, b)
    assert max_diff(weights(out["single"], 2), weights(multi, 2)) <= 1e-5
    single_eval = json.loads((out["single"] / "results.json").read_text())
    multi_eval = json.loads((multi / "results.json").read_text())
    assert multi_eval["final"]["eval/pass@1"] == single_eval["final"]["eval/pass@1"]  # same chunks, same seeds
    ckpt = multi / "checkpoints" / "step_1"
    assert sorted(p.name for p in (ckpt / "optim_dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = tmp / "two_nodes_resumed"
    outs = two_nodes([f"hydra.run.dir={resumed}", "dist.strategy=fsdp2", f"resume={ckpt}"], tmp)
    assert "resumed from" in outs[0]
    assert max_diff(weights(resumed, 2), weights(multi, 2)) <= 1e-6


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_fsdp2_rank_with_one_token_outputs_stays_in_step(tmp_path, layout):
    """Rank 0's micro-batch holds only one-token outputs (predicted by the prefixes' last logits alone), rank 1's
    longer ones. Rank 0 skipped the outputs' forward, so its layer all-gathers fell out of step with rank 1's:
    the job hung until the process group's timeout. Now both finish, and rank 0's log-probs are those of one
    unsharded process."""
    from tests.helpers import prefix_cache_case, prefix_cache_logprobs, tiny

    proc = run_script("tests/fsdp_one_token.py", ["30", layout, str(tmp_path)], ROOT,
                      {**env(tmp_path), "PYTHONPATH": str(ROOT)}, timeout=300, ranks=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (logp0, _), _ = ([float(v) for v in (tmp_path / f"rank{r}.txt").read_text().split()] for r in (0, 1))
    model, tok = tiny()
    _, distinct, prefix_of, completions = prefix_cache_case()
    with torch.no_grad():
        one = prefix_cache_logprobs(model, distinct, prefix_of, [c[:1] for c in completions], 9, tok.pad_token_id)[0]
    assert abs(logp0 - one.sum().item()) < 1e-4


@pytest.fixture(scope="module")
def async_single(runs):
    """One process drawing both prompt shards from its rollout worker (rollout.async_steps=1)."""
    tmp, _ = runs
    one_process([f"hydra.run.dir={tmp / 'async_single'}", "rollout.async_steps=1", "train.sampler_check_every=1"], tmp)
    return tmp / "async_single"


@pytest.mark.parametrize("gathered", [False, True], ids=["defaults", "reshard_after_forward=false"])
def test_rollout_workers_under_torchrun_match_one_process(runs, async_single, gathered):
    """rollout.async_steps=1 under FSDP2 on two ranks (rank 0 owns the worker, every rank joins the weight
    gathering, each takes its prompt shard of each batch) against one process drawing both shards from its worker.
    [reshard_after_forward=false]: the no-grad passes leave each rank's parameters gathered; the weights of the
    batch's version are swapped into the shards, not into the gathered copies, and no forward after reads those."""
    tmp, _ = runs
    single, multi = async_single, tmp / f"async_fsdp2_{gathered}"
    two_processes([f"hydra.run.dir={multi}", "rollout.async_steps=1", "dist.strategy=fsdp2", "train.sampler_check_every=1",
                   *(["dist.reshard_after_forward=false"] if gathered else [])], tmp)
    rows = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness_max"] for r in rows if "rollout/staleness_max" in r] == [0.0, 1.0]
    # the sampler against the trainer at the weights that sampled (step 2's: those before the update, swapped into
    # every rank's shards), not at the trainer's current ones, which moved: staleness does not count
    for run_dir in (single, multi):
        steps = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
                 if "train/loss" in r]
        assert [r["rollout/token_prob_ratio"] < 1 + 1e-5 for r in steps] == [True, True], run_dir.name
        assert steps[1]["rollout/logprob_diff"] > 1e-4  # ... which the stale batch's gap to pi_old shows
    a, b = losses(single), losses(multi)
    assert len(a) == len(b) == 2 and all(abs(x - y) <= 1e-5 for x, y in zip(a, b)), (a, b)
    assert max_diff(weights(single, 2), weights(multi, 2)) <= 1e-5


def test_a_rollout_worker_started_elsewhere_draws_what_one_started_here_does(runs, async_single):
    """A worker on another node: the trainer starts none (rollout.remote_workers=1 on a fixed rollout.worker_port) and
    waits; the worker is started apart, as ``python -m bicc.rollout.worker --connect <host>:<port>`` from the
    repository root (docs/slurm/train_async_2x4.sbatch), before the trainer's store is up, and waits for it 10 s at
    most, while the trainer is 15 s longer than that to load (its reward's check): the trainer serves the store as it
    starts, and the worker waits as long as it is there. The run equals the one whose worker the trainer started,
    and the worker ends by itself when the trainer is done."""
    tmp, _ = runs
    remote, port = tmp / "async_remote", free_port()
    worker = subprocess.Popen([sys.executable, "-m", "bicc.rollout.worker", "--connect", f"127.0.0.1:{port}",
                               "--timeout-s", "10"], cwd=ROOT, env=env(tmp), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    proc = one_process([f"hydra.run.dir={remote}", "rollout.async_steps=1", "rollout.remote_workers=1",
                        f"rollout.worker_port={port}", "train.sampler_check_every=1", "dist.timeout_minutes=2",
                        "data.reward=tests.rewards:first_of_group_slow_start"], tmp)
    assert "1 from other nodes" in proc.stdout and "rollout worker 0 (cpu on " in proc.stdout
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, out[-3000:]
    assert losses(remote) == losses(async_single)
    assert max_diff(weights(async_single, 2), weights(remote, 2)) == 0
