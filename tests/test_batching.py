"""Length-aware micro-batches and per-micro-batch padding (bicc/kernels/batching.py): the plan by hand, the trimmed
columns by hand, and the gradient against one forward over the whole padded batch (how every step ran
before micro-batches were cut by length)."""

import pytest
import torch

from bicc.kernels.batching import _size, logprobs_no_grad, micro_batches, plan_micro_batches, trim_rows
from bicc.kernels.rows import QueryRows
from bicc.method.losses import LOSSES, StepTotals
from bicc.model.load import build_tiny
from bicc.model.logprobs import batch_logprobs, make_token_batch
from tests.conftest import compose_cfg
from tests.helpers import ARCH, kv_case


def padded_tokens(plan: list[torch.Tensor], lengths: torch.Tensor) -> int:
    """Tokens the forwards over ``plan`` compute, ``lengths`` as in ``plan_micro_batches``."""
    parts = (lengths if lengths.dim() == 2 else lengths[:, None]).tolist()
    return sum(_size(mb.tolist(), parts)[0] for mb in plan if len(mb))


def test_plan_by_hand():
    lengths = torch.tensor([10, 10, 9, 4, 4, 20])
    # longest first: 20 alone (a second row makes 2 x 20 = 40 > 30 tokens) | 10, 10, 9 (3 x 10 = 30 padded for
    # 29 real) | 4, 4 (the 4 would make 4 x 10 = 40 > 30)
    plan = plan_micro_batches(torch.arange(6), lengths, size=4, tokens=30)
    assert [mb.tolist() for mb in plan] == [[5], [0, 1, 2], [3, 4]]
    assert padded_tokens(plan, lengths) == 20 + 30 + 8
    # without a token limit the padding cap cuts the same places: 20 + 10 padded to 40 > 1.1 x 30 real
    assert [mb.tolist() for mb in plan_micro_batches(torch.arange(6), lengths, size=6, tokens=10_000)] == [[5], [0, 1, 2], [3, 4]]
    fixed = plan_micro_batches(torch.arange(6), lengths, size=4)
    assert [mb.tolist() for mb in fixed] == [[0, 1, 2, 3], [4, 5]]
    assert padded_tokens(fixed, lengths) == 4 * 10 + 2 * 20
    # padding-free forwards (ragged): a micro-batch costs its real tokens, no padding cap: 20 + 10 | 10 + 9 + 4 + 4
    ragged = plan_micro_batches(torch.arange(6), lengths, size=4, tokens=30, ragged=True)
    assert [mb.tolist() for mb in ragged] == [[5, 0], [1, 2, 3, 4]]
    # the row cap; a subset of rows is planned on its own
    assert [mb.tolist() for mb in plan_micro_batches(torch.tensor([2, 1, 0]), lengths, size=2, tokens=1000)] == [[1, 0], [2]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        plan_micro_batches(torch.arange(6), lengths, size=0)


def test_plan_counts_longest_prompt_plus_longest_output():
    # (prompt, output) lengths, 10 tokens each: rows 0 and 1 together are 2 x (6 + 8) = 28 wide for 20 real
    # tokens (> 1.1 x 20); rows 1 and 2, 2 x (6 + 5) = 22 for 20
    lengths = torch.tensor([[2, 8], [6, 4], [5, 5]])
    plan = plan_micro_batches(torch.arange(3), lengths, size=4, tokens=100)
    assert [mb.tolist() for mb in plan] == [[0], [1, 2]]
    assert padded_tokens(plan, lengths) == 10 + 22
    assert [mb.tolist() for mb in plan_micro_batches(torch.arange(3), lengths.sum(-1), size=4, tokens=100)] == [[0, 1, 2]]


def test_trim_rows_by_hand():
    # prompts of 2 and 4 tokens (width 4), outputs of 1 and 2 tokens padded to 5
    batch = make_token_batch([[7, 8], [5, 6, 7, 8]], [[9], [9, 3]], pad_id=0, length=5)
    part = trim_rows(batch.rows(torch.tensor([0])))
    assert part.input_ids.tolist() == [[7, 8, 9]]  # two all-padding prompt columns and four output columns cut
    assert part.position_ids.tolist() == [[0, 1, 2]]
    assert part.completion_mask.tolist() == [[1]]
    both = trim_rows(batch)
    assert both.input_ids.shape == (2, 6) and both.completion_mask.shape == (2, 2)


@pytest.mark.parametrize("tokens", [0, 24])
def test_gradient_equals_one_padded_forward(tokens):
    """Ragged rows cut by length (or in fixed slices) and each micro-batch trimmed give the gradient of
    one forward over the whole padded batch, to 1e-6 in fp32."""
    cfg = compose_cfg(["algo=dapo", "rollout.max_new_tokens=16", "train.micro_batch_size=3",
                       f"train.micro_batch_tokens={tokens}"])
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 90, (int(n),), generator=gen).tolist() for n in torch.randint(2, 9, (10,), generator=gen)]
    outputs = [torch.randint(4, 90, (int(n),), generator=gen).tolist() for n in torch.randint(1, 17, (10,), generator=gen)]
    batch = make_token_batch(prompts, outputs, 0)
    adv = torch.linspace(-1.0, 1.2, 10)
    loss_fn = LOSSES.get(cfg.algo.loss)
    totals = StepTotals.of(batch.completion_mask, cfg.rollout.max_new_tokens)

    reference, _ = build_tiny(ARCH, seed=0)
    logp, _ = batch_logprobs(reference, batch)
    loss, _ = loss_fn(logp, logp.detach(), None, adv, batch.completion_mask, cfg.algo, totals)
    loss.backward()

    model, _ = build_tiny(ARCH, seed=0)
    plain = QueryRows(batch)
    plan = micro_batches(torch.arange(10), plain, cfg.train.micro_batch_size, tokens, model)
    assert sorted(torch.cat(plan).tolist()) == list(range(10)) and len(plan) > 1
    if tokens:
        assert padded_tokens(plan, plain.lengths) < padded_tokens(list(torch.arange(10).split(3)), plain.lengths)
    for rows in plan:
        logp, _ = plain.logprobs(model, rows, 1.0)
        assert (logp[batch.completion_mask[rows] == 0] == 0).all()  # zeros past each output
        loss, _ = loss_fn(logp, logp.detach(), None, adv[rows], batch.completion_mask[rows], cfg.algo, totals)
        loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert q.grad.abs().max() > 0 or p.grad.abs().max() == 0
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", ["kv", "mask"])
def test_conditioned_logprobs_do_not_depend_on_the_plan(impl):
    """BiCC's packed numerator over length-aware micro-batches gives the log-probs of one forward over every
    row."""
    from omegaconf import OmegaConf

    from bicc.kernels.rows import ContextRows
    from bicc.method.conditioning import ConditionedPrompts

    gen = torch.Generator().manual_seed(5)
    contexts = [torch.randint(4, 90, (n,), generator=gen).tolist() for n in (12, 9, 7)]
    rows = [0, 0, 0, 1, 1, 2, 2, 2]  # which context each output follows
    outputs = [torch.randint(4, 90, (int(n),), generator=gen).tolist() for n in torch.randint(1, 12, (8,), generator=gen)]
    prompts = ConditionedPrompts([contexts[k] for k in rows], rows, torch.ones(8, dtype=torch.bool))
    bicc_cfg = OmegaConf.create({"context_packing": True, "max_packed_len": 256, "context_packing_impl": impl})
    numerator = ContextRows(prompts, outputs, max(map(len, outputs)), bicc_cfg, 0, torch.device("cpu"))
    model, _ = build_tiny(ARCH, seed=0)
    model.config._attn_implementation = "sdpa"
    whole = logprobs_no_grad(model, numerator, 8, 8, 1.0)
    plan = micro_batches(torch.arange(8), numerator, 8, 40, model)
    assert len(plan) > 1
    torch.testing.assert_close(logprobs_no_grad(model, numerator, 8, 8, 1.0, micro_batch_tokens=40), whole,
                               atol=1e-5, rtol=0)


def test_kv_contexts_are_computed_once_per_step():
    """Under KV reuse a context is one forward per step, however its outputs are cut into micro-batches:
    the tokens embedded are the three contexts once (left-padded to the longest, 3 x 12) plus each
    micro-batch's outputs, padded to its longest, less the last token (it predicts nothing)."""
    numerator, contexts, outputs = kv_case()
    model, _ = build_tiny(ARCH, seed=0)
    model.config._attn_implementation = "sdpa"
    embedded = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    plan = micro_batches(torch.arange(8), numerator, 8, 16, model)
    assert [mb.tolist() for mb in plan] == [[0], [4], [2, 6], [3, 7], [1], [5]]  # outputs 11 | 9 | 7, 7 | 3, 3 | 2 | 1
    logprobs_no_grad(model, numerator, 8, 8, 1.0, micro_batch_tokens=16)
    hook.remove()
    # a 1-token output needs no forward of its own: the context's last position predicts it
    assert embedded == [3 * 12, 1 * 10, 1 * 8, 2 * 6, 2 * 2, 1 * 1]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_kv_gradient_over_micro_batches_equals_one_row_per_output(checkpointing):
    """Contexts computed once, outputs in micro-batches, each micro-batch's backward leaving its share of the
    gradient on the contexts' keys/values, one backward through the contexts at the end: the gradient of one
    plain forward over every [context; output] row, to 1e-6 in fp64; also under activation checkpointing in
    train mode (the presets' combination), where the context layers are replayed in that last backward."""
    numerator, contexts, outputs = kv_case()
    model, _ = build_tiny(ARCH, seed=0)
    reference, _ = build_tiny(ARCH, seed=0)
    for m in (model, reference):
        m.double()
        m.config._attn_implementation = "sdpa"
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    weights = torch.randn(8, 11, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    plan = micro_batches(torch.arange(8), numerator, 8, 16, model)
    assert len(plan) > 2
    with numerator.contexts_once(model, torch.arange(8)):
        for rows in plan:
            logp, _ = numerator.logprobs(model, rows, 1.0)
            (logp * weights[rows]).sum().backward()
    batch = make_token_batch(numerator.contexts.prompt_ids, outputs, 0)
    logp, _ = batch_logprobs(reference, batch, 1.0)
    (logp * batch.completion_mask * weights).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert q.grad.abs().max() > 0
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)


def test_no_micro_batch_of_several_rows_exceeds_the_token_cap():
    """The promise of ``train.micro_batch_tokens``: a micro-batch's padded size, rows x (its longest prompt + its
    longest output), stays within the cap (a row longer than the cap goes alone), and within 1.1 x its real
    tokens; every row is planned once. Over random (prompt, output) lengths and caps."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        lengths = torch.stack([torch.randint(1, 60, (n,), generator=gen), torch.randint(1, 80, (n,), generator=gen)], -1)
        cap, size = int(torch.randint(20, 600, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        plan = plan_micro_batches(torch.arange(n), lengths, size, cap)
        assert sorted(torch.cat(plan).tolist()) == list(range(n))
        for mb in plan:
            padded = len(mb) * int(lengths[mb].max(0).values.sum())
            assert len(mb) == 1 or (padded <= cap and padded <= 1.1 * int(lengths[mb].sum()) and len(mb) <= size)


@pytest.mark.parametrize("bicc", ["off", "on"])
def test_the_update_forwards_stay_within_the_token_cap(bicc, monkeypatch):
    """End to end: in an RL step with ``train.micro_batch_tokens`` every trainer forward of several rows embeds at
    most that many tokens (padding included), the BiCC numerator's one-row-per-output forwards too (on a GPU, more
    is an OOM the memory budget did not plan for)."""
    from bicc.config import StepConfig
    from bicc.data import build_task
    from bicc.rollout import build_engine
    from bicc.rollout.collect import Collection
    from bicc.trainer.step import rl_step
    from tests.helpers import CoinTask, state_for

    cap = 200  # rows of 45-62 tokens: three at most
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", f"bicc={bicc}", "rcc=off", "train.context_packing=false",
                       "train.share_prompts=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
                       "rollout.max_new_tokens=24", "bicc.min_attempt_tokens=4", "train.micro_batch_size=16",
                       f"train.micro_batch_tokens={cap}"])
    model, tok = build_tiny(ARCH, seed=0)
    s = state_for(model)
    s.tokenizer, s.task, s.engine = tok, CoinTask(build_task(cfg.data)), build_engine("hf", model, tok, cfg.rollout)
    s.collection = Collection.of(cfg.algo, cfg.rollout, cfg.data)
    shapes, sampling = [], []  # the trainer's forwards (rows, columns); not the engine's
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: None if sampling else shapes.append(args[0].shape))
    generate = s.engine.generate
    monkeypatch.setattr(s.engine, "generate", lambda *a, **k: (sampling.append(1), generate(*a, **k), sampling.clear())[1])
    metrics, _ = rl_step(s, StepConfig.of(cfg))
    assert bicc == "off" or metrics["bicc/samples_conditioned_share"] > 0
    assert len(shapes) > 2 and any(rows > 1 for rows, _ in shapes)
    assert all(rows * cols <= cap for rows, cols in shapes if rows > 1), shapes


def test_the_update_never_packs_past_the_cap_on_real_tokens():
    """Rows whose real tokens fit the cap but whose padded size does not go apart. Prompts of 6 tokens, outputs of
    12, 11, 11, 10: rows of 18, 17, 17, 16 tokens. At a cap of 35 the 18 goes alone (with a 17: 2 x 18 = 36 padded
    for 35 real), then 17 + 17 (34), then 16; the update's forwards and the no-grad passes embed exactly those."""
    from bicc.trainer.update import update_policy
    from tests.helpers import state_for

    gen = torch.Generator().manual_seed(0)
    outputs = [torch.randint(4, 90, (n,), generator=gen).tolist() for n in (12, 11, 11, 10)]
    batch = make_token_batch([[5, 6, 7, 8, 9, 10]] * 4, outputs, 0)
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "rollout.max_new_tokens=16", "train.micro_batch_size=8",
                       "train.micro_batch_tokens=35"])
    model, _ = build_tiny(ARCH, seed=0)
    shapes = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    plain = QueryRows(batch)
    old = logprobs_no_grad(model, plain, 4, 8, 1.0, micro_batch_tokens=35)
    update_policy(state_for(model), batch, plain, old, None, torch.tensor([1.0, -1.0, 0.5, -0.5]), cfg, 0)
    assert shapes == [(1, 18), (2, 17), (1, 16)] * 2
