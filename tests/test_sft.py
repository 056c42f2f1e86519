"""Warm-start data: demonstrations, optional context-bearing prompts, cache keys."""

from bicc.data import build_task
from bicc.sft import cache_key, demonstration_batch
from bicc.tokenizer import build_char_tokenizer
from tests.conftest import compose_cfg

TOK = build_char_tokenizer()


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
    targets = lambda b: [TOK.decode(r[m.bool()].tolist()) for r, m in zip(b.input_ids[:, -b.completion_len:], b.completion_mask)]  # noqa: E731
    assert targets(plain) == targets(with_ctx)


def test_cache_key_tracks_context_share_and_keeps_old_keys():
    base = compose_cfg(["sft.cache_dir=/tmp/x"])
    assert cache_key(base) == cache_key(compose_cfg(["sft.cache_dir=/tmp/y"]))  # the cache dir is not a setting
    assert cache_key(base) != cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "sft.context_share=0.5"]))
    assert cache_key(base) != cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "sft.steps=10"]))


def test_cache_key_ignores_inactive_task_settings():
    base = compose_cfg(["sft.cache_dir=/tmp/x"])
    assert cache_key(base) == cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "data.math.train_source=/elsewhere.jsonl"]))
    assert cache_key(base) != cache_key(compose_cfg(["sft.cache_dir=/tmp/x", "data.arith.max_operand=20"]))
