"""BiCC's conditioned rows (ContextRows): with an empty context they give exactly the base variant's numerator."""

import pytest
import torch

from bicc.kernels.rows import ContextRows, Packing, QueryRows
from bicc.method.conditioning import ConditionedPrompts, build_contexts
from bicc.method.losses import LOSSES, StepTotals
from tests.helpers import BiccCfg, rows_setup
from tests.losses.helpers import LOSS_OF, VARIANTS


@pytest.mark.parametrize("packing", [(True, "kv"), (True, "mask"), (False, "kv")])
@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_context_reduces_to_base_variant(packing, variant):
    model, tok, prompts, completions, batch = rows_setup()
    empty = ConditionedPrompts([list(p) for p in prompts], list(range(4)), torch.zeros(4, dtype=torch.bool))
    conditioned = ContextRows(empty, completions, batch.completion_len,
                              Packing(context_packing=packing[0], context_packing_impl=packing[1]), tok.pad_token_id,
                              torch.device("cpu"))
    rows = torch.arange(4)
    a, _ = conditioned.logprobs(model, rows, 1.0)
    b, _ = QueryRows(batch).logprobs(model, rows, 1.0)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)
    old = b.detach() + 0.05 * torch.randn(b.shape, generator=torch.Generator().manual_seed(3))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    totals = StepTotals.of(batch.completion_mask, batch.completion_len)
    loss_a, _ = LOSSES.get(LOSS_OF[variant])(a, old, old, adv, batch.completion_mask, VARIANTS[variant], totals)
    loss_b, _ = LOSSES.get(LOSS_OF[variant])(b, old, old, adv, batch.completion_mask, VARIANTS[variant], totals)
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-6)


@pytest.mark.parametrize("impl", ["kv", "mask"])
def test_packed_and_unpacked_conditioned_numerators_agree(impl):
    model, tok, prompts, completions, batch = rows_setup()
    correct = torch.tensor([1.0, 0.0, 1.0, 0.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    texts = ["Compute 1+1."] * 2 + ["Compute 22+1."] * 2
    ctx = build_contexts(texts, completions, correct, group_ids, tok, BiccCfg(min_attempt_tokens=4), 64, prompts)
    assert ctx.conditioned.all()
    rows = torch.arange(4)
    packed = ContextRows(ctx, completions, batch.completion_len,
                         Packing(context_packing=True, context_packing_impl=impl), tok.pad_token_id, "cpu")
    unpacked = Packing(context_packing=False)
    single = ContextRows(ctx, completions, batch.completion_len, unpacked, tok.pad_token_id, "cpu")
    a, _ = packed.logprobs(model, rows, 1.0)
    b, _ = single.logprobs(model, rows, 1.0)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)
    plain, _ = QueryRows(batch).logprobs(model, rows, 1.0)
    assert (a[m] - plain[m]).abs().max() > 1e-3  # the context really changes the numerator


def test_mixed_shared_and_single_prefixes_keep_row_order():
    model, tok, prompts, completions, batch = rows_setup()
    # rows 0 and 2 share a (made-up) prefix, rows 1 and 3 stand alone
    shared_prefix = prompts[0] + [50, 51, 52]
    ctx = ConditionedPrompts([shared_prefix, prompts[1], shared_prefix, prompts[3]], [7, 1, 7, 3],
                             torch.ones(4, dtype=torch.bool))
    rows = torch.tensor([3, 0, 1, 2])  # any order
    packed = ContextRows(ctx, completions, batch.completion_len, Packing(context_packing=True), tok.pad_token_id, "cpu")
    single = ContextRows(ctx, completions, batch.completion_len, Packing(context_packing=False), tok.pad_token_id, "cpu")
    a, ea = packed.logprobs(model, rows, 1.0, with_entropy=True)
    b, eb = single.logprobs(model, rows, 1.0, with_entropy=True)
    m = batch.completion_mask[rows].bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ea[m], eb[m], atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides, per_row_prefix", [([], False), (["train.context_packing=false"], True),
                                                         (["train.context_packing_impl=mask"], True)])
def test_the_train_keys_choose_how_context_rows_are_laid_out(overrides, per_row_prefix):
    """``cfg.train`` is what ContextRows reads: KV reuse plans on outputs alone (each context computed once, apart),
    one row per output and mask packing carry the prefix in each planned row."""
    from tests.conftest import compose_cfg

    _, tok, prompts, completions, batch = rows_setup()
    ctx = ConditionedPrompts([p + [50, 51] for p in prompts], [0, 0, 1, 1], torch.ones(4, dtype=torch.bool))
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", *overrides])
    rows = ContextRows(ctx, completions, batch.completion_len, cfg.train, tok.pad_token_id, "cpu")
    assert bool((rows.lengths[:, 0] > 0).all()) is per_row_prefix and bool((rows.lengths[:, 0] == 0).all()) is not per_row_prefix
