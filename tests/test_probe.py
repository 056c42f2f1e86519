"""The gradient-alignment probe: its built-in identity check (x^c = q through the conditioned path gives the
plain gradient), and its conditioning weight on a model that copies what the context shows."""

from types import SimpleNamespace

import pytest
import torch

from bicc.config import TinyArchConfig
from bicc.method.advantages import ADVANTAGES
from bicc.model.load import build_tiny
from bicc.model.tokenizer import build_char_tokenizer
from bicc.rollout import RolloutOutput
from bicc.rollout.collect import Rollout
from bicc.trainer.probe import alignment, identity_gap, probe_batch
from tests.conftest import compose_cfg


def rollout(tok, answers_right, answers_wrong, groups=3, G=4):
    """Groups of G outputs to a question, half right and half wrong, as token ids of the char tokenizer."""
    from bicc.data import encode_prompt

    prompts, out_prompt, completions, correct = [], [], [], []
    for g in range(groups):
        question = f"Number {g}: so the result is what?"  # every letter of the outputs is already in q
        q = encode_prompt(tok, question)
        for i in range(G):
            right = i % 2 == 0
            text = f"so the result is {answers_right[g] if right else answers_wrong[g]}"
            completions.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            prompts.append(question)
            out_prompt.append(q)
            correct.append(1.0 if right else 0.0)
    correct = torch.tensor(correct)
    out = RolloutOutput(out_prompt, completions, [""] * len(completions), [True] * len(completions))
    return Rollout(out, prompts, correct, correct.clone(), torch.arange(groups).repeat_interleave(G), groups, 1)


def probe_cfg(*extra):
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "bicc=on", "rcc=off", "bicc.max_tokens=200", "rollout.max_new_tokens=40",
                       "train.micro_batch_size=5", *extra])
    return cfg


def test_identity_gradient_equals_the_plain_one_and_contexts_change_it():
    tok = build_char_tokenizer()
    model, _ = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16), seed=0)
    model.double()
    ro = rollout(tok, ["41", "17", "8"], ["40", "19", "9"])
    out = probe_batch(model, tok, ro, probe_cfg(), ("answer is",), [tok.eos_token_id], torch.device("cpu"),
                      ADVANTAGES.get("grpo"))
    g = out["grads"]
    assert g["g_q"].norm() > 1e-3  # mixed groups: a real gradient
    assert (g["g_0"] - g["g_q"]).abs().max().item() <= 1e-8  # the built-in check (fp64; rotary tables are fp32)
    assert identity_gap(g["g_0"], g["g_q"]) <= 1e-6  # relative; the fp32 rotary tables leave ~3e-8
    a = alignment(g)
    assert a["g_0"]["cos"] == pytest.approx(1.0, abs=1e-9)
    for form in ("g_1", "g_P", "g_perm", "g_tmpl"):
        assert a[form]["cos"] < 1 - 1e-6  # the contexts change the gradient
    assert out["conditioned_share"] == 1.0 and len(out["log_w_pos"]) == 6 and len(out["log_w_neg"]) == 6


def test_identity_gap_is_relative_to_the_plain_gradient():
    g_q = torch.tensor([3.0, 4.0])  # |g_q| = 5
    assert identity_gap(torch.tensor([3.0, 4.5]), g_q) == pytest.approx(0.5 / 5)
    assert identity_gap(1e3 * torch.tensor([3.0, 4.5]), 1e3 * g_q) == pytest.approx(0.5 / 5)  # scale-free
    assert identity_gap(torch.tensor([0.0, 2.0]), torch.zeros(2)) == pytest.approx(1.0)  # g_q = 0: against |g_0|
    assert identity_gap(torch.zeros(2), torch.zeros(2)) == 0.0


class CopyModel(torch.nn.Module):
    """A stand-in LM whose next-token logits favour tokens that already appear in the row: a model that reuses
    what a context shows it."""

    def __init__(self, vocab: int, bonus: float = 4.0):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(vocab, dtype=torch.float64))
        self.vocab, self.bonus = vocab, bonus
        self.config = SimpleNamespace(_attn_implementation="eager")  # it reads a 2-D padding mask, as given to eager

    def get_output_embeddings(self):
        return None

    def forward(self, input_ids, attention_mask, position_ids=None, logits_to_keep=0, use_cache=False, **_):
        seen = torch.nn.functional.one_hot(input_ids, self.vocab).double() * attention_mask[..., None]  # [B, T, V]
        logits = self.bias + self.bonus * (seen.cumsum(1) > 0).double()  # [B, T, V]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_right_answer_in_context_lowers_w_of_wrong_outputs():
    """Incorrect outputs are shown the correct attempts (x- = [q; O+]): a model that uses the shown right answer
    finds its own wrong answer less likely than on q, so w < 1 on O- (the paper's case study)."""
    tok = build_char_tokenizer()
    ro = rollout(tok, ["7", "7", "7"], ["3", "3", "3"])
    cfg = probe_cfg("train.context_packing=false")
    out = probe_batch(CopyModel(len(tok)), tok, ro, cfg, ("answer is",), [tok.eos_token_id], torch.device("cpu"),
                      ADVANTAGES.get("grpo"))
    assert max(out["log_w_neg"]) < 0  # w < 1 on every incorrect output
    # the placebo shows another group's attempts with the same answers, so it moves w the same way: the probe
    # separates content from template only where groups differ; the template alone shows no answer
    assert min(out["log_w_tmpl"]) > max(out["log_w_neg"])


def test_the_probe_partitions_as_the_step_does():
    """Under algo.partition=reward a right output whose shaped reward is 0.3 is on the wrong side of the probe's
    contexts too: the conditioning weights equal those of the same rollout whose verdicts say so."""
    import dataclasses

    tok = build_char_tokenizer()
    shaped = rollout(tok, ["7", "7", "7"], ["3", "3", "3"])
    shaped.rewards[0::4] = 0.3  # the first right output of each group, taken below 0.5 by the shaping
    as_verdicts = dataclasses.replace(shaped, correct=(shaped.rewards > 0.5).float())

    def log_w(ro, *extra):
        out = probe_batch(CopyModel(len(tok)), tok, ro, probe_cfg("train.context_packing=false", *extra),
                          ("answer is",), [tok.eos_token_id], torch.device("cpu"), ADVANTAGES.get("grpo"))
        return sorted(out["log_w_pos"] + out["log_w_neg"])

    assert log_w(shaped, "algo.partition=reward") == pytest.approx(log_w(as_verdicts), abs=1e-12)
    assert log_w(shaped) != pytest.approx(log_w(as_verdicts), abs=1e-6)  # by the verdict, another partition
