import pytest
import torch

from bicc.config import TinyArchConfig
from bicc.data import encode_prompt
from bicc.rollout import ENGINES, SamplingParams, build_engine


class RolloutCfg:
    batch_size = 6  # forces several generate chunks


@pytest.fixture(scope="module")
def engine():
    from bicc.models import build_tiny

    model, tok = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=0)
    return build_engine("hf", model, tok, RolloutCfg)


def prompts(tok):
    return [encode_prompt(tok, t) for t in ("Compute 1+2.", "Compute 10-3+4.", "Compute 7.")]


def test_rows_grouped_by_prompt_and_cut_at_eos(engine):
    tok = engine.tokenizer
    ps = prompts(tok)
    out = engine.generate(ps, SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0))
    assert len(out.completion_ids) == len(out.texts) == len(out.finished) == 12
    for i, ids in enumerate(out.completion_ids):
        assert out.prompt_ids[i] == ps[i // 4]
        assert len(ids) <= 12
        assert out.finished[i] == (ids[-1] == tok.eos_token_id if ids else False)
        assert tok.eos_token_id not in ids[:-1]
        assert out.texts[i] == tok.decode(ids, skip_special_tokens=True)


def test_seed_makes_sampling_reproducible_and_leaves_global_rng(engine):
    ps = prompts(engine.tokenizer)
    state = torch.random.get_rng_state()
    a = engine.generate(ps, SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=5))
    b = engine.generate(ps, SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=5))
    c = engine.generate(ps, SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=6))
    assert a.completion_ids == b.completion_ids != c.completion_ids
    assert torch.equal(torch.random.get_rng_state(), state)


def test_greedy_repeats_one_decode(engine):
    ps = prompts(engine.tokenizer)
    out = engine.generate(ps, SamplingParams(n=3, temperature=0.0, top_p=1.0, max_new_tokens=8, seed=0))
    assert len(out.completion_ids) == 9
    assert out.completion_ids[0] == out.completion_ids[1] == out.completion_ids[2]


def test_update_weights_copies_from_another_module(engine):
    from bicc.models import build_tiny

    other, _ = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=1)
    engine.update_weights(other)
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), other.parameters()))


def test_engine_registry_names():
    assert "hf" in ENGINES
