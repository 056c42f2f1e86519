"""Model FLOPs of the forwards a step makes, counted from the rows it computes (``bicc.kernels.rows``) as
``bicc.kernels.packing`` lays them out: 2 per non-embedding parameter per embedded token, 2 x hidden x vocab per
predicted token (the output projection) and 4 x layers x attention width per query-key pair (scores and
the weighted sum); a forward + backward counts 3 forwards. The ratio of two steps' counts is their time
ratio where every FLOP costs the same in both (``bench.step_profile``, ``bench.step_model``); larger
forwards often run at a better FLOP rate, so a measured ratio can come out somewhat below it."""

from __future__ import annotations


def forward_work(rows) -> tuple[int, int, int]:
    """(tokens embedded, tokens predicted, attention query-key pairs) of one forward over every row of ``rows``
    (``bicc.kernels.rows``): a shared prefix of W tokens once (W(W+1)/2 pairs), then each output of n tokens behind it
    less its last (n - 1 queries, the t-th attending to W + t keys); unshared prefixes once per row."""
    if not hasattr(rows, "contexts"):  # one padded row per output: prompt and output both per row
        lengths = rows.lengths.tolist()
        return (sum(w + n for w, n in lengths), sum(n for _, n in lengths),
                sum((w + n) * (w + n + 1) // 2 for w, n in lengths))
    seen, embedded, pairs = set(), 0, 0
    for prefix, key, out in zip(rows.contexts.prompt_ids, rows.contexts.context_key, rows.completion_ids):
        W, n = len(prefix), len(out)
        if not rows.packing or key not in seen:
            seen.add(key)
            embedded, pairs = embedded + W, pairs + W * (W + 1) // 2
        embedded += max(n - 1, 0)
        pairs += max(n - 1, 0) * W + (n - 1) * n // 2
    return embedded, sum(map(len, rows.completion_ids)), pairs


def work_flops(model, rows, passes: float) -> float:
    """Model FLOPs of ``passes`` forwards over ``rows`` (a forward + backward counts 3): 2 per
    non-embedding parameter per embedded token, 2 x hidden x vocab per predicted token (the output
    projection) and 4 x layers x attention width per query-key pair (scores and the weighted sum)."""
    config = model.config
    body = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    if not config.tie_word_embeddings:
        body -= model.get_output_embeddings().weight.numel()
    embedded, predicted, pairs = forward_work(rows)
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return passes * (2 * body * embedded + 2 * config.hidden_size * config.vocab_size * predicted
                     + 4 * config.num_hidden_layers * width * pairs)


def plan_flops(plan, model, on_q, on_xc) -> float:
    """FLOPs of a step's no-grad passes and its update (``bicc.trainer.plan.StepPlan``), the rows on q and on x^c given."""
    rows = {"q": on_q, "xc": on_xc}
    total = work_flops(model, rows[plan.update_context], 3)
    return total + sum(work_flops(model, rows[ctx], 1) for _, ctx in plan.passes)
