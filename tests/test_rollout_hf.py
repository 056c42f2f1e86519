import pytest
import torch

from bicc.config import TinyArchConfig
from bicc.data import encode_prompt
from bicc.rollout import ENGINES, SamplingParams, build_engine


class RolloutCfg:
    batch_size = 6  # forces several generate chunks


@pytest.fixture(scope="module")
def engine():
    from bicc.model.load import build_tiny

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
    from bicc.model.load import build_tiny

    other, _ = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=1)
    engine.update_weights(other, 3)
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), other.parameters()))
    assert engine.version == 3  # what the rollouts it samples from now on are stamped with


def test_sampling_at_top_p_1_draws_from_the_whole_vocabulary():
    """T = 1, top-p 1 (the paper's training sampling) samples from the full softmax: no top-k cut (HF's global
    default is top_k = 50). A random-init model is close to uniform over the character vocabulary, so 4,000
    first tokens of one prompt show more than 50 distinct ids, and their frequencies follow the softmax; with
    top-p 0.5 they keep to the smallest set holding half the mass."""
    from bicc.model.load import build_tiny

    model, tok = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=0)
    engine = build_engine("hf", model, tok, type("Cfg", (), {"batch_size": 4000}))
    prompt = encode_prompt(tok, "Compute 1+2.")
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert int((probs > 1e-4).sum()) > 60  # the premise: a spread-out distribution
    first = lambda top_p: torch.tensor([ids[0] for ids in engine.generate(  # noqa: E731
        [prompt], SamplingParams(n=4000, temperature=1.0, top_p=top_p, max_new_tokens=1, seed=0)).completion_ids])
    full = first(1.0)
    assert len(set(full.tolist())) > 50
    freq = torch.bincount(full, minlength=probs.numel()).float() / full.numel()
    assert 0.5 * (freq - probs).abs().sum() < 0.12  # total variation; ~0.06 expected from 4,000 draws
    nucleus = torch.sort(probs, descending=True)
    keep = set(nucleus.indices[: int((nucleus.values.cumsum(0) < 0.5).sum()) + 1].tolist())
    assert set(first(0.5).tolist()) <= keep


def test_a_static_cache_samples_what_the_growing_cache_samples(engine):
    """rollout.hf.static_cache: the same greedy and seeded samples and the same sampling log-probs as transformers'
    growing cache, over ragged left-padded prompts in several chunks (the cache allocated whole for each call)."""
    from types import SimpleNamespace

    tok, model = engine.tokenizer, engine.model
    ps = prompts(tok)
    engines = [build_engine("hf", model, tok, SimpleNamespace(batch_size=6, old_from_sampler=True,
                                                              hf=SimpleNamespace(static_cache=static)))
               for static in (False, True)]
    assert [e.cache for e in engines] == [None, "static"]
    caches = []  # the cache each forward of generate got: the check below would pass with the same kind twice
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: caches.append(type(kwargs["past_key_values"]).__name__),
                                           with_kwargs=True)
    for sampling in (SamplingParams(n=2, temperature=0.0, top_p=1.0, max_new_tokens=10, seed=0),
                     SamplingParams(n=4, temperature=1.0, top_p=0.9, max_new_tokens=10, seed=3)):
        caches.clear()
        growing = engines[0].generate(ps, sampling)
        assert set(caches) == {"DynamicCache"}
        caches.clear()
        static = engines[1].generate(ps, sampling)
        assert set(caches) == {"StaticCache"}
        assert static.completion_ids == growing.completion_ids and static.finished == growing.finished
        if growing.logprobs is not None:
            flat = lambda out: torch.tensor([x for row in out.logprobs for x in row])  # noqa: E731  (rows are ragged)
            torch.testing.assert_close(flat(static), flat(growing), atol=1e-5, rtol=0)
    hook.remove()


def test_every_engine_implements_the_whole_contract_and_the_trainer_never_probes_one(engine):
    """Every registered engine subclasses ``Engine``, so each member exists (a no-op where it means nothing), and
    the trainer and evaluation call them as they are, never through ``hasattr`` / ``getattr`` on an engine."""
    import ast
    import typing

    from bicc.rollout import Engine
    from tests.conftest import ROOT

    members = set(typing.get_type_hints(Engine)) | {n for n in vars(Engine) if not n.startswith("_")}
    assert {"generate", "update_weights", "sleep", "close", "model", "returns_logprobs", "kv_bytes"} <= members
    for name in ENGINES.names():
        assert Engine in ENGINES.get(name).__mro__, name
    assert isinstance(engine, Engine) and engine.kv_bytes is None and engine.returns_logprobs is False
    engine.sleep(), engine.close()  # no-ops for HF: they exist and return
    probes = []
    for path in [*(ROOT / "bicc" / "trainer").glob("*.py"), *(ROOT / "bicc" / "evaluation").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and node.args
                    and "engine" in ast.unparse(node.args[0])):
                probes.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes
