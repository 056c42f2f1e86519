"""Warm-start data: demonstrations, optional context-bearing prompts, cache keys."""

import math

import pytest
import torch

from bicc.data import build_task
from bicc.model.logprobs import make_token_batch
from bicc.model.tokenizer import build_char_tokenizer
from bicc.trainer.sft import cache_key, demonstrations
from tests.conftest import compose_cfg

TOK = build_char_tokenizer()


def demonstration_batch(task, tokenizer, indices, seed, context_share=0.0, bicc_cfg=None, context_attempts="independent"):
    """The rows of ``demonstrations`` as one padded batch."""
    prompts, completions, _ = demonstrations(task, tokenizer, indices, seed, context_share, bicc_cfg, context_attempts)
    return make_token_batch(prompts, completions, tokenizer.pad_token_id)


def decoded_rows(batch):
    return [TOK.decode(row[mask.bool()].tolist()) for row, mask in zip(batch.input_ids, batch.attention_mask)]


def test_context_share_adds_attempts_to_prompts_only():
    cfg = compose_cfg(["sft.cache_dir=/tmp/x"])
    task = build_task(cfg.data)
    plain = demonstration_batch(task, TOK, list(range(16)), 0)
    with_ctx = demonstration_batch(task, TOK, list(range(16)), 0, 1.0, cfg.bicc)
    preamble = cfg.bicc.preamble
    assert not any(preamble in text for text in decoded_rows(plain))
    assert all(preamble in text for text in decoded_rows(with_ctx))
    # the targets are the same demonstrations: the context does not change what is learned to output
    assert targets_of(plain) == targets_of(with_ctx)


def test_cache_key_tracks_context_share():
    base = compose_cfg(["sft.cache_dir=/tmp/x"])
    assert cache_key(base) == cache_key(compose_cfg(["sft.cache_dir=/tmp/y"]))  # the cache dir is not a setting
    assert cache_key(base) != cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "sft.context_share=0.5"]))
    assert cache_key(base) != cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "sft.steps=10"]))


def test_cache_key_ignores_inactive_task_settings():
    base = compose_cfg(["sft.cache_dir=/tmp/x"])
    assert cache_key(base) == cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "data.math.train_source=/elsewhere.jsonl"]))
    assert cache_key(base) != cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "data.arith.max_operand=20"]))


def test_informative_attempts_mix_right_and_wrong_under_a_correct_target():
    """sft.context_attempts=informative: the attempts shown are right or slipped with probability 1/2 and the
    target is always right, so a warm start can learn to reuse a right attempt and not repeat a wrong one."""
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "rollout.max_new_tokens=160"])
    task = build_task(cfg.data)
    indices = list(range(200))
    batch = demonstration_batch(task, TOK, indices, 0, 1.0, cfg.bicc, "informative")
    rows = decoded_rows(batch)
    targets = targets_of(batch)
    problems = [task.train_problem(i) for i in indices]
    assert all(task.reward(t, p) == 1.0 for t, p in zip(targets, problems))  # every target is right
    prompts = [row[: row.rindex(t)] for row, t in zip(rows, targets)]
    shown = [[task.reward(a, p) for a in prompt.split("Attempt ")[1:]] for prompt, p in zip(prompts, problems)]
    flat = [r for s in shown for r in s]
    assert 0.35 < sum(flat) / len(flat) < 0.65  # attempts right about half the time
    assert any(0 < sum(s) < len(s) for s in shown) and any(sum(s) == 0 for s in shown) and any(sum(s) == len(s) for s in shown)
    # independent attempts keep the task's targets (slips included) and draw the same RNG stream as before
    independent = demonstration_batch(task, TOK, indices, 0, 1.0, cfg.bicc)
    wrong = [t for t, p in zip(targets_of(independent), problems) if task.reward(t, p) == 0.0]
    assert 0.15 < len(wrong) / len(problems) < 0.45  # slip_rate 0.3


def targets_of(batch):
    return [TOK.decode(r[m.bool()].tolist()) for r, m in zip(batch.input_ids[:, -batch.completion_len:], batch.completion_mask)]


def test_cache_key_tracks_context_attempts_only_when_attempts_are_shown():
    base = compose_cfg(["sft.cache_dir=/tmp/x"])
    assert cache_key(base) == cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "sft.context_attempts=informative"]))
    shown = lambda kind: cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "sft.context_share=0.5",  # noqa: E731
                                                f"sft.context_attempts={kind}"]))
    assert shown("informative") != shown("independent")
    assert shown("independent") == cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "sft.context_share=0.5"]))


def test_sft_loss_runs_plain_and_context_rows_apart_with_the_one_batch_loss_and_gradient():
    """Rows with attempts are padded and run apart from plain rows (their padding would multiply the plain
    rows' cost); the loss and gradient are the one-batch token mean's."""
    import torch

    from bicc.method.losses.agg import masked_mean
    from bicc.model.load import build_tiny
    from bicc.model.logprobs import batch_logprobs
    from bicc.trainer.sft import demonstrations, sft_loss

    cfg = compose_cfg(["sft.cache_dir=/tmp/x"])
    task = build_task(cfg.data)
    prompts, completions, shown = demonstrations(task, TOK, list(range(12)), 0, 0.5, cfg.bicc, "informative")
    assert 0 < sum(shown) < len(shown)
    model, _ = build_tiny(cfg.model.tiny, seed=0)
    model = model.double()
    loss = sft_loss(model, prompts, completions, shown, TOK.pad_token_id, torch.device("cpu"))
    split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    batch = demonstration_batch(task, TOK, list(range(12)), 0, 0.5, cfg.bicc, "informative")
    logp, _ = batch_logprobs(model, batch)
    reference = -masked_mean(logp, batch.completion_mask)
    reference.backward()
    assert torch.allclose(loss, reference.detach(), atol=1e-12)
    assert all(torch.allclose(a, p.grad, atol=1e-10) for a, p in zip(split, model.parameters()))


def test_the_data_keys_only_rl_reads_leave_the_warm_start_as_it_was():
    """Rewards' extras and the prompt length limit shape RL, not the warm start: setting them reuses the cache;
    a key the warm start reads (the arithmetic's operands) does not."""
    base = cache_key(compose_cfg(["sft.cache_dir=/tmp/x"]))
    rl_only = ["data.rewards=[tests.rewards:brevity]", "data.reward_weights=[0.5]", "data.reward_errors=zero",
               "data.max_prompt_length=64", "data.prompt_overflow=truncate"]
    assert cache_key(compose_cfg(["sft.cache_dir=/tmp/x", *rl_only])) == base
    assert cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "data.arith.max_operand=50"])) != base


def test_no_sft_steps_starts_rl_from_the_built_model():
    """``sft.steps=0``: the warm start is the tiny model as built (its seed's weights), with nothing trained; a
    negative count is refused naming the field."""
    from bicc.data import build_task
    from bicc.model.load import build_tiny
    from bicc.trainer.sft import sft_seed, train_sft
    from bicc.trainer.validation import validate
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "sft.steps=0"])
    validate(cfg)
    model, _, metrics = train_sft(cfg, build_task(cfg.data), torch.device("cpu"), progress=False)
    assert metrics["sft/steps"] == 0 and math.isnan(metrics["sft/loss"])
    built, _ = build_tiny(cfg.model.tiny, sft_seed(cfg))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), built.state_dict().values()))
    with pytest.raises(ValueError, match="config field 'sft.steps'"):
        validate(compose_cfg(["sft.cache_dir=/tmp/x", "sft.steps=-1"]))
