"""An engine that writes chosen final answers instead of sampling them, named by dotted path
(``rollout.engine=tests.scripted_engine:ScriptedEngine``) so that a rollout worker, which only receives the name,
builds it too. Every output ends in one of ``ANSWERS`` (``\\boxed{...}``), picked by the call's seed, so a test knows
what each sample must score whatever the weights are; every one of them needs math-verify against the gold
``\\frac{1}{2}`` (the checker's fast path cannot decide it). Log-probs are the policy's own, log softmax(logits / T),
as a sampler's are."""

import random

import torch

from bicc.rollout import RolloutOutput, SamplingParams
from bicc.rollout.engines.hf import HFEngine

GOLD = "\\frac{1}{2}"
# answer -> its score against GOLD (math-verify decides each: none is the gold's text, none is a plain number pair)
ANSWERS = {"\\frac{2}{4}": 1.0, "\\frac{1}{3}": 0.0, "0.5": 1.0, "\\frac{3}{4}": 0.0, "2^{-1}": 1.0,
           "\\sqrt{\\frac{1}{4}}": 1.0}


def written(text: str) -> str:
    """The answer a scripted output wrote."""
    return text.rsplit("\\boxed{", 1)[1][:-1]


class ScriptedEngine(HFEngine):
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        rng = random.Random(sampling.seed)
        out = RolloutOutput([], [], [], [], logprobs=[] if self.returns_logprobs else None)
        device = next(self.model.parameters()).device
        for prompt in prompts:
            for _ in range(sampling.n):
                text = f"so \\boxed{{{rng.choice(sorted(ANSWERS))}}}"
                ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.end_ids[0]]
                out.prompt_ids.append(list(prompt))
                out.completion_ids.append(ids)
                out.texts.append(text)
                out.finished.append(True)
                if out.logprobs is not None:
                    seq = torch.tensor([list(prompt) + ids], device=device)
                    logits = self.model(seq).logits[0, len(prompt) - 1 : -1].float() / sampling.temperature
                    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids, device=device)[:, None])
                    out.logprobs.append(picked.squeeze(-1).tolist())
        return out


def problems_file(path, n: int) -> None:
    """``n`` problems whose answer is ``GOLD``, in the JSONL layout ``data=jsonl`` reads."""
    import json

    path.write_text("".join(json.dumps({"id": f"half-{i}", "problem": f"Problem {i}: what is one half?",
                                        "answer": GOLD}) + "\n" for i in range(n)))
