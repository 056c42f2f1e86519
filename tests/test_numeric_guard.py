"""A non-finite loss or gradient skips the optimizer step, counts it, and leaves weights and Adam state
untouched; a finite step resets the streak."""

import torch

from bicc.config import TinyArchConfig
from bicc.logprobs import make_token_batch
from bicc.models import build_tiny
from bicc.numerator import PlainNumerator
from bicc.optim import build_optimizer, warmup_cosine
from bicc.trainer import RLState, logprobs_no_grad, update_policy
from tests.conftest import compose_cfg


def setup():
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


def test_nonfinite_advantage_skips_the_step_and_finite_resets_the_streak():
    state, batch, cfg = setup()
    plain = PlainNumerator(batch)
    old = logprobs_no_grad(state.model, plain, 4, 4, 1.0)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    bad = torch.tensor([1.0, float("nan"), -1.0, 0.5])
    for _ in range(2):
        metrics, _ = update_policy(state, batch, plain, old, None, bad, cfg, 0)
        assert metrics["train/nonfinite_skip"] == 1.0
    assert state.nonfinite_skips == 2 and state.nonfinite_streak == 2
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    assert state.optimizer.state_dict()["state"] == {} and state.scheduler.last_epoch == 0
    metrics, _ = update_policy(state, batch, plain, old, None, torch.tensor([1.0, -1.0, -1.0, 1.0]), cfg, 1)
    assert metrics["train/nonfinite_skip"] == 0.0
    assert state.nonfinite_skips == 2 and state.nonfinite_streak == 0
    assert any(not torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    assert state.trainer_state()["nonfinite_skips"] == 2
