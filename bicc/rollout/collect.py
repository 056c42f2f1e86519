"""Rollout collection for one RL step: prompts from this process's shards, G samples each from the engine,
rewards (with DAPO's overlong shaping), dynamic sampling's refills (DAPO's rules: ``bicc.method.dapo``). (The
sampler's log-probs against the trainer's: ``bicc.method.losses.tis``.)"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from bicc.data import encode_prompt, scored
from bicc.method.advantages import ADVANTAGES
from bicc.method.dapo import mixed_groups, overlong_buffer_tokens, overlong_penalty
from bicc.rollout import RolloutOutput, SamplingParams


@dataclass(frozen=True)
class Collection:
    """What one step samples and keeps (``of``): ``prompts_per_step`` queries (over all shards) x
    ``group_size`` samples at ``temperature`` / ``top_p``, at most ``max_new_tokens`` each; DAPO's dynamic sampling
    (``dynamic_sampling``: groups whose correctness is all 0 or all 1 are dropped and more queries drawn, in at most
    ``max_rounds`` generate calls) and overlong shaping (``overlong_buffer`` tokens, ``overlong_penalty``); prompts
    longer than ``max_prompt_length`` tokens (None: no limit) are dropped for the next problems, or under
    ``prompt_overflow="truncate"`` cut to their last ``max_prompt_length`` tokens (as TRL cuts them). Under
    ``greedy_baseline`` (an advantage that asks for it: ReMax's) each query also gets one greedy output, scored
    and shaped as the samples are: ``Rollout.baseline``."""

    prompts_per_step: int
    group_size: int
    temperature: float
    top_p: float
    max_new_tokens: int
    dynamic_sampling: bool = False
    max_rounds: int = 1
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_prompt_length: int | None = None
    prompt_overflow: str = "drop"
    greedy_baseline: bool = False

    @classmethod
    def of(cls, algo, r, data) -> "Collection":
        """The rule of a run's ``algo``, ``rollout`` (``r``) and ``data`` groups."""
        return cls(r.prompts_per_step, r.group_size, r.temperature, r.top_p, r.max_new_tokens, bool(algo.dynamic_sampling),
                   algo.max_sampling_rounds, overlong_buffer_tokens(algo, r.max_new_tokens), algo.overlong_penalty,
                   data.max_prompt_length, data.prompt_overflow,
                   bool(getattr(ADVANTAGES.get(algo.advantage), "greedy_baseline", False)))

    def keep(self, correct: torch.Tensor) -> torch.Tensor:
        """[groups] which groups of ``correct`` [groups, G] are kept: every one, or (dynamic sampling) the mixed."""
        if not self.dynamic_sampling:
            return torch.ones(correct.shape[0], dtype=torch.bool)
        return mixed_groups(correct)


@dataclass
class DataCursor:
    """Where the next training problems are read (what a checkpoint keeps): ``pos`` with one prompt shard;
    with several, ``shard_pos[s]`` for shard s, which reads problems s, s + S, s + 2S, ... Collection advances it."""

    pos: int = 0
    shard_pos: list = field(default_factory=list)


@dataclass
class Rollout:
    """One step's samples, grouped by query (G consecutive rows per query).

    out:       the engine's output, N = num_groups * G rows
    prompts:   N user-turn texts (each row's query)
    correct:   [N] binary correctness (what BiCC partitions on)
    rewards:   [N] training reward: correctness plus any shaping
    group_ids: [N] query index of each row
    prompts_drawn / rounds: how many queries and generate calls it took (dynamic sampling draws more)
    generate_s: seconds spent in those generate calls
    """

    out: RolloutOutput
    prompts: list[str]
    correct: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    prompts_drawn: int
    rounds: int
    generate_s: float = 0.0  # seconds inside the engine's generate calls
    version: int = 0  # the weight version that drew it (``Engine.version``: optimizer steps behind those weights)
    reward_parts: dict = field(default_factory=dict)  # each named reward function's [N] values (data.rewards)
    prompts_over_length: int = 0  # prompts over data.max_prompt_length, dropped or truncated
    baseline: torch.Tensor | None = None  # [N] the reward of the greedy output of each row's query (greedy_baseline)

    def to_plain(self) -> dict:
        """Lists, numbers and tensors only: what a checkpoint holds (read back with ``weights_only``)."""
        out = {f: getattr(self.out, f) for f in (*FIELDS, "logprobs")}
        return {"out": out, "prompts": self.prompts, "correct": self.correct, "rewards": self.rewards,
                "group_ids": self.group_ids, "prompts_drawn": self.prompts_drawn, "rounds": self.rounds,
                "generate_s": self.generate_s, "version": self.version, "reward_parts": self.reward_parts,
                "prompts_over_length": self.prompts_over_length, "baseline": self.baseline}

    @classmethod
    def from_plain(cls, d: dict) -> "Rollout":
        return cls(**{**d, "out": RolloutOutput(**d["out"])})


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of RL step ``step`` of a run seeded ``seed`` (each shard and dynamic-sampling round
    derives its own from it): a step's samples are a function of (weights, data position, seed, step)."""
    return seed * 1_000_003 + step


FIELDS = ("prompt_ids", "completion_ids", "texts", "finished")


def _concat(outputs: list[RolloutOutput]) -> RolloutOutput:
    out = RolloutOutput(*(sum((getattr(o, f) for o in outputs), []) for f in FIELDS))
    if all(o.logprobs is not None for o in outputs):
        out.logprobs = sum((o.logprobs for o in outputs), [])
    return out


def _select(out: RolloutOutput, rows: list[int]) -> RolloutOutput:
    part = RolloutOutput(*([getattr(out, f)[r] for r in rows] for f in FIELDS))
    if out.logprobs is not None:
        part.logprobs = [out.logprobs[r] for r in rows]
    return part


def collect_rollout(engine, tokenizer, task, plan: Collection, cursor: DataCursor, seed: int, shards=(0,),
                    num_shards: int = 1) -> Rollout:
    """The rollout of prompt shards ``shards`` out of ``num_shards`` (``bicc.machine.distributed``), sampled by ``engine``
    from ``task``'s training problems at ``cursor`` (advanced past them): each shard is ``prompts_per_step /
    num_shards`` queries with its own seed and its own position in the data, so a shard's samples do not depend
    on which process draws it. One shard (the default) is the whole step. Groups are numbered over the returned
    shards."""
    if num_shards > 1 and len(cursor.shard_pos) != num_shards:
        cursor.shard_pos = [0] * num_shards
    parts = [_collect_shard(engine, tokenizer, task, plan, cursor, seed + 104_729 * shard, shard, num_shards)
             for shard in shards]
    for part in parts:
        part.version = engine.version
    return merge_shards(parts, plan.group_size)


def merge_shards(parts: list[Rollout], group_size: int) -> Rollout:
    """One rollout of the shards' rollouts ``parts`` in order, groups numbered over all of them; its version is
    the oldest part's."""
    if len(parts) == 1:
        return parts[0]
    offsets = [0]
    for p in parts[:-1]:
        offsets.append(offsets[-1] + len(p.correct) // group_size)
    return Rollout(_concat([p.out for p in parts]), [t for p in parts for t in p.prompts],
                   torch.cat([p.correct for p in parts]), torch.cat([p.rewards for p in parts]),
                   torch.cat([p.group_ids + o for p, o in zip(parts, offsets)]),
                   sum(p.prompts_drawn for p in parts), max(p.rounds for p in parts), sum(p.generate_s for p in parts),
                   min(p.version for p in parts),
                   {k: torch.cat([p.reward_parts[k] for p in parts]) for k in parts[0].reward_parts},
                   sum(p.prompts_over_length for p in parts),
                   None if parts[0].baseline is None else torch.cat([p.baseline for p in parts]))


def _problems(task, cursor: DataCursor, want: int, shard: int, num_shards: int) -> list:
    """The next ``want`` training problems of ``shard``; the cursor moves past them."""
    if num_shards == 1:
        problems = [task.train_problem(cursor.pos + i) for i in range(want)]
        cursor.pos += want
        return problems
    pos = cursor.shard_pos[shard]
    cursor.shard_pos[shard] += want
    return [task.train_problem((pos + i) * num_shards + shard) for i in range(want)]


def _collect_shard(engine, tokenizer, task, plan: Collection, cursor: DataCursor, seed: int, shard: int,
                   num_shards: int) -> Rollout:
    """Sample G outputs for each of the shard's queries and score them; under dynamic sampling draw more
    queries for the groups it drops, up to ``plan.max_rounds`` generate calls; a batch still short after that
    is used as is."""
    P, G = plan.prompts_per_step // num_shards, plan.group_size
    kept: list[tuple[RolloutOutput, list[str], torch.Tensor, torch.Tensor, dict, torch.Tensor | None]] = []
    num_kept, drawn, rounds, generate_s, over = 0, 0, 0, 0.0, 0
    while num_kept < P and rounds < plan.max_rounds:
        want = P - num_kept
        problems, prompts, skipped = _fitting_problems(task, tokenizer, plan, cursor, want, shard, num_shards)
        drawn += want + skipped
        over += skipped + sum(len(p) > (plan.max_prompt_length or len(p)) for p in prompts)
        if plan.max_prompt_length:  # "truncate": the prompt's last tokens (drop left none longer)
            prompts = [p[-plan.max_prompt_length:] for p in prompts]
        sampling = SamplingParams(n=G, temperature=plan.temperature, top_p=plan.top_p,
                                  max_new_tokens=plan.max_new_tokens, seed=seed + 7919 * rounds)
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        generate_s += time.perf_counter() - start
        rounds += 1
        golds = [problems[i // G] for i in range(len(out.texts))]
        values, named = scored(task, out.texts, golds)
        correct = torch.tensor(values).view(want, G)
        named = {k: torch.tensor(v, dtype=torch.float) for k, v in named.items()}
        lengths = torch.tensor([len(c) for c in out.completion_ids]).view(want, G)
        shaped = correct.double() + overlong_penalty(lengths, plan.max_new_tokens, plan.overlong_buffer,
                                                     plan.overlong_penalty)  # [want, G]
        queries = [problems[i // G].prompt for i in range(want * G)]  # each row's user-turn text
        baseline = greedy_rewards(engine, task, plan, problems, prompts, sampling.seed) if plan.greedy_baseline else None
        last_draw = (out, queries, correct.flatten(), shaped.flatten(), named, baseline)
        rows = (plan.keep(correct).nonzero() * G + torch.arange(G)).flatten().tolist()  # sample rows of the kept groups
        if rows:
            part = _select(out, rows)
            kept.append((part, [queries[r] for r in rows], correct.flatten()[rows], shaped.flatten()[rows],
                         {k: v[rows] for k, v in named.items()}, None if baseline is None else baseline[rows]))
            num_kept += len(rows) // G
    if not kept:  # every group was degenerate in every round: train on the last draw (zero advantages)
        kept.append(last_draw)
    out = _concat([k[0] for k in kept])
    prompts = [text for k in kept for text in k[1]]
    correct = torch.cat([k[2] for k in kept])
    rewards = torch.cat([k[3] for k in kept]).float()
    group_ids = torch.arange(len(correct) // G).repeat_interleave(G)
    parts = {k: torch.cat([k_[4][k] for k_ in kept]) for k in kept[0][4]}
    baseline = None if kept[0][5] is None else torch.cat([k[5] for k in kept]).float()
    return Rollout(out, prompts, correct, rewards, group_ids, drawn, rounds, generate_s, reward_parts=parts,
                   prompts_over_length=over, baseline=baseline)


def greedy_rewards(engine, task, plan: Collection, problems, prompts, seed: int) -> torch.Tensor:
    """[len(prompts) x G] the shaped reward of one greedy output (temperature 0) of each query, repeated over its G
    rows: ReMax's baseline."""
    out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=plan.max_new_tokens,
                                                  seed=seed))
    values, _ = scored(task, out.texts, problems)
    lengths = torch.tensor([[len(c)] for c in out.completion_ids])
    shaped = torch.tensor(values).double() + overlong_penalty(lengths, plan.max_new_tokens, plan.overlong_buffer,
                                                              plan.overlong_penalty)[:, 0]
    return shaped.repeat_interleave(plan.group_size)


def _fitting_problems(task, tokenizer, plan: Collection, cursor: DataCursor, want: int, shard: int, num_shards: int):
    """``want`` problems of the shard and their encoded prompts; under ``max_prompt_length`` with ``drop``, a prompt
    over it is skipped for the next problem (counted). Returns (problems, prompts, how many were skipped)."""
    problems = _problems(task, cursor, want, shard, num_shards)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    if not plan.max_prompt_length or plan.prompt_overflow != "drop":
        return problems, prompts, 0
    kept = [(p, ids) for p, ids in zip(problems, prompts) if len(ids) <= plan.max_prompt_length]
    skipped = want - len(kept)
    while len(kept) < want:
        if skipped > 100 * want:
            raise ValueError(f"config field 'data.max_prompt_length': {skipped} training prompts in a row are longer "
                             f"than {plan.max_prompt_length} tokens; raise it, or data.prompt_overflow=truncate")
        (problem,) = _problems(task, cursor, 1, shard, num_shards)
        ids = encode_prompt(tokenizer, problem.prompt)
        if len(ids) <= plan.max_prompt_length:
            kept.append((problem, ids))
        else:
            skipped += 1
    return [p for p, _ in kept], [ids for _, ids in kept], skipped


def rollout_metrics(ro: Rollout, group_size: int) -> dict:
    """``reward/`` and ``rollout/`` of a step's rollout, its groups of ``group_size`` outputs."""
    lengths = torch.tensor([len(c) for c in ro.out.completion_ids], dtype=torch.float32)
    return {"reward/accuracy": ro.correct.mean().item(), "reward/mean": ro.rewards.mean().item(),
            "rollout/response_len": lengths.mean().item(),
            "rollout/truncated_share": 1 - sum(ro.out.finished) / len(ro.out.finished),
            "rollout/prompts_drawn": ro.prompts_drawn, "rollout/generate_rounds": ro.rounds,
            "rollout/prompts_over_length": float(ro.prompts_over_length),
            "rollout/groups": len(ro.correct) // group_size,
            **{f"reward/{name}": float(v.sum() if name == "scoring_errors" else v.mean())
               for name, v in ro.reward_parts.items()}}
