import torch

from bicc.config import TinyArchConfig
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch, token_logprobs


def tiny_model():
    model, tok = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=0)
    return model.eval(), tok


def rows():
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13]]
    completions = [[20, 21, 2], [22, 23, 24, 25, 26], [27]]
    return prompts, completions


def test_padded_batch_equals_one_row_per_sample():
    model, tok = tiny_model()
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, tok.pad_token_id)
    assert batch.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_len)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids = torch.tensor([p + c])
            single, _ = token_logprobs(model, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], len(c))
            torch.testing.assert_close(logp[i, : len(c)], single[0], atol=1e-5, rtol=0)


def test_single_row_matches_manual_log_softmax():
    model, _ = tiny_model()
    ids = torch.tensor([[1, 5, 6, 7, 8, 20, 21]])
    with torch.no_grad():
        logp, entropy = token_logprobs(model, ids, torch.ones_like(ids), torch.arange(7)[None], 2, with_entropy=True)
        full = torch.log_softmax(model(ids).logits.float(), -1)
    torch.testing.assert_close(logp[0], torch.stack([full[0, 4, 20], full[0, 5, 21]]), atol=1e-5, rtol=0)
    by_hand = -(full[0, 4:6].exp() * full[0, 4:6]).sum(-1)  # -sum p log p at the two predicting positions
    torch.testing.assert_close(entropy[0], by_hand, atol=1e-5, rtol=0)


def test_4d_mask_matches_2d_mask():
    model, tok = tiny_model()
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, tok.pad_token_id)
    n, t = batch.input_ids.shape
    keep = batch.attention_mask.bool()
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    mask4d = causal[None, None] & keep[:, None, None, :]  # [N, 1, T, T]
    mask4d |= torch.eye(t, dtype=torch.bool)[None, None]  # padded query rows attend to themselves (no NaN)
    with torch.no_grad():
        a, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_len)
        b, _ = token_logprobs(model, batch.input_ids, mask4d, batch.position_ids, batch.completion_len)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)


def test_temperature_scales_logits():
    model, _ = tiny_model()
    ids = torch.tensor([[1, 5, 6, 20]])
    with torch.no_grad():
        hot, _ = token_logprobs(model, ids, torch.ones_like(ids), torch.arange(4)[None], 1, temperature=2.0)
        logits = model(ids).logits[0, 2] / 2.0
    torch.testing.assert_close(hot[0, 0], torch.log_softmax(logits, -1)[20], atol=1e-5, rtol=0)


def test_sdpa_padding_mask_by_hand_and_as_transformers_builds_it():
    """Row [pad, a, b] and row [a, b, c]: the pad query reads itself only, each real query the real keys up to
    itself. Given to the model, it gives the logits that transformers' own mask from the 2-D one gives, at every
    real position; under SDPA the model is handed the 4-D form (transformers would read the 2-D one's values), under
    eager attention the 2-D mask as it is."""
    from bicc.model.logprobs import attention_input, sdpa_padding_mask

    mask = sdpa_padding_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert mask[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    model, tok = tiny_model()
    assert model.config._attn_implementation == "sdpa"
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, tok.pad_token_id)
    with torch.no_grad():
        theirs = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
        ours = model(batch.input_ids, attention_mask=sdpa_padding_mask(batch.attention_mask),
                     position_ids=batch.position_ids).logits
    real = batch.attention_mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
    assert attention_input(model, batch.attention_mask).shape == (3, 1, 10, 10)  # prompts to 5, outputs to 5
    model.config._attn_implementation = "eager"
    assert attention_input(model, batch.attention_mask) is batch.attention_mask
