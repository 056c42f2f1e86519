"""The check at launch that a run fits its GPU: the run's shape and sizes read from its config (``arch_of``,
``model_arch``, ``run_of``), ``bicc.machine.memory``'s peak against the memory it may use (``check_fit``), and the
settings that shrink a phase (``knob``)."""

from __future__ import annotations

import dataclasses

from bicc.config import RunConfig, StepConfig
from bicc.machine.memory import GIB, Arch, Run, peak
from bicc.method.conditioning import context_budget

# Model types whose layout bicc.machine.memory counts: dense decoders with one attention and one MLP per layer.
COUNTED = ("qwen2", "qwen3", "llama", "mistral", "phi3")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class UncountedModel(ValueError):
    """A model whose layout the memory model does not count (a mixture of experts, another architecture)."""


def arch_of(config) -> Arch:
    """The shape of an HF model config (Qwen3, Llama, Phi-3 layouts); ``UncountedModel`` names what it cannot
    count (experts, another model type, a missing size)."""
    model_type = getattr(config, "model_type", None)
    experts = [k for k in MOE_KEYS if getattr(config, k, None)]
    if experts:
        raise UncountedModel(f"{model_type} is a mixture of experts ({', '.join(f'{k}={getattr(config, k)}' for k in experts)})")
    if model_type not in COUNTED:
        raise UncountedModel(f"model type {model_type!r} is not one of the dense layouts it counts ({', '.join(COUNTED)})")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if getattr(config, k, None) is None]
    if missing:
        raise UncountedModel(f"{model_type} config has no {', '.join(missing)}")
    heads = config.num_attention_heads
    return Arch(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                intermediate=config.intermediate_size, vocab=config.vocab_size,
                tied=bool(getattr(config, "tie_word_embeddings", False)))


def run_of(cfg: StepConfig, model_cfg, eval_cfg, dist_cfg, world: int, sharded: bool, gpu_gib: float,
           prompt_tokens: int) -> Run:
    """What of the run's config sizes memory on one of ``world`` GPUs of ``gpu_gib`` (every output at
    ``rollout.max_new_tokens``, the longest training prompt ``prompt_tokens``): the step's groups, the model's,
    the evaluation's and the distribution's."""
    from bicc.machine.distributed import DTYPES
    from bicc.model.load import resolve_attn_implementation
    from bicc.rollout import ENGINES
    from bicc.trainer.plan import StepPlan, loads_reference

    r, t, e = cfg.rollout, cfg.train, eval_cfg
    compute = DTYPES[dist_cfg.param_dtype] if sharded and dist_cfg.param_dtype else DTYPES[model_cfg.dtype]
    engine = ENGINES.get(r.engine)
    plan = StepPlan.from_config(cfg, engine.always_returns_logprobs or bool(r.old_from_sampler))
    return Run(world=world, micro_batch=t.micro_batch_size, output_tokens=r.max_new_tokens, prompt_tokens=prompt_tokens,
               context_ratio=(cfg.bicc.context_ratio if cfg.bicc.truncate != "none"  # attempts whole: all they hold
                              else context_budget(cfg.bicc, r.max_new_tokens) / r.max_new_tokens), bicc=bool(cfg.bicc.enabled),
               contexts=max(1, 2 * r.prompts_per_step // world),
               reference=loads_reference(cfg) and not model_cfg.lora.r,  # LoRA: the policy, adapters off
               chunk_tokens=t.logprob_chunk_tokens, vllm_utilization=r.vllm.gpu_memory_utilization, gpu_gib=gpu_gib,
               compute_bytes=compute.itemsize, rows=max(1, r.prompts_per_step * r.group_size // world),
               no_grad_on_context=any(ctx == "xc" for _, ctx in plan.passes),
               master_bytes=DTYPES[model_cfg.master_dtype].itemsize, sharded=sharded, vllm=engine.reserves_memory_share,
               eval_vllm=engine.reserves_memory_share,
               eval_batch_tokens=e.batch_tokens, eval_new_tokens=e.max_new_tokens,
               eval_rows=min(e.batch_size, e.limit * e.samples_per_problem if e.limit else e.batch_size),
               flash=resolve_attn_implementation(model_cfg.attn_implementation) == "flash_attention_2",
               rollout_batch=r.batch_size, compiled=model_cfg.compile in ("on", "auto"),  # auto: on a GPU
               reshard_after_forward=dist_cfg.reshard_after_forward, reshard_after_backward=dist_cfg.reshard_after_backward,
               reduce_per_step=dist_cfg.reduce_grads == "step",
               checkpoint_policy=model_cfg.checkpoint_policy if model_cfg.gradient_checkpointing else "full",
               checkpoint_layers=checkpoint_setting(model_cfg),
               push_bucket_bytes=int(r.push_bucket_mib * 2**20) if r.async_steps else 0,
               lora_rank=model_cfg.lora.r,
               lora_targets=tuple(model_cfg.lora.target_modules) if model_cfg.lora.r else ())


def checkpoint_setting(model_cfg) -> int | None:
    """``model.checkpoint_layers`` as ``bicc.machine.memory`` counts it: None for every layer (``all``, and ``auto`` until
    ``resolve_checkpoint_layers`` sets it), 0 without ``model.gradient_checkpointing``."""
    if not model_cfg.gradient_checkpointing:
        return 0
    setting = str(model_cfg.checkpoint_layers)
    return None if setting in ("all", "auto") else int(setting)


AUTO_SHARE = 0.9  # of the budget that auto fills: an H100's reserved memory ran 1.22x its allocated peak


def resolve_checkpoint_layers(arch: Arch, run: Run, budget_gib: float) -> int:
    """``model.checkpoint_layers=auto``: the fewest checkpointed layers (from the first up) whose predicted peak fits
    ``AUTO_SHARE`` of ``budget_gib`` (the presets' own target: 72 of 80 GiB); every layer where none does (the fit
    check then says what else to lower)."""
    for n in range(arch.layers + 1):
        if peak(arch, dataclasses.replace(run, checkpoint_layers=n))[1] <= AUTO_SHARE * budget_gib * GIB:
            return n
    return arch.layers


def knob(phase: str, run: Run) -> str:
    """The settings that shrink ``phase``'s peak."""
    if phase in ("rollout", "evaluation") and run.vllm:
        return "rollout.vllm.gpu_memory_utilization (vLLM's share of the GPU)"
    if phase == "evaluation":
        return "eval.batch_tokens (rows x tokens per HF generate call)"
    if phase == "optimizer step":
        return "more GPUs (torchrun --nproc_per_node, dist.strategy=fsdp2 shards weights, gradients and AdamW)"
    # FSDP2's options that hold more than the default (bicc.machine.memory)
    keep_fwd = ["dist.reshard_after_forward=true"] if run.sharded and not run.reshard_after_forward else []
    if phase == "no-grad log-probs":
        return ", ".join(["train.logprob_chunk_tokens", *keep_fwd])
    update = ["train.micro_batch_size or train.micro_batch_tokens, train.logprob_chunk_tokens"]
    update += keep_fwd + (["dist.reshard_after_backward=true"] if run.sharded and not run.reshard_after_backward else [])
    if run.checkpoint_layers is not None:  # layers outside the checkpoint hold their activations
        update.append("model.checkpoint_layers (more layers checkpointed, model.gradient_checkpointing=true)")
    return ", ".join(update + (["dist.reduce_grads=micro_batch"] if run.sharded and run.reduce_per_step else []))


def check_fit(arch: Arch, run: Run, budget_gib: float) -> str:
    """The prediction against ``budget_gib`` as one line; raises ValueError naming the knob to turn when the
    largest phase does not fit."""
    phase, value = peak(arch, run)
    line = (f"predicted peak {value / GIB:.1f} GiB per GPU ({phase}) of {budget_gib:.1f} GiB "
            f"(every output at {run.output_tokens} tokens, micro-batch {run.micro_batch})")
    if value > budget_gib * GIB:
        raise ValueError(f"config field 'train.memory_gib': {line}: it does not fit. Lower {knob(phase, run)}; "
                         "or set train.memory_check=false to start anyway")
    return line


def model_arch(model_cfg, vocab: int) -> Arch:
    """The shape of the configured model, read without loading weights (``model.tiny``, or the config.json at
    ``model.path``); ``vocab``: the tokenizer's size (a tiny model's vocabulary)."""
    t = model_cfg.tiny
    if t is not None:
        return Arch(hidden=t.hidden_size, layers=t.num_hidden_layers, heads=t.num_attention_heads,
                    kv_heads=t.num_key_value_heads, head_dim=t.head_dim, intermediate=t.intermediate_size, vocab=vocab,
                    tied=bool(t.tie_word_embeddings))
    from transformers import AutoConfig

    return arch_of(AutoConfig.from_pretrained(model_cfg.path))


def auto_layers(model_cfg) -> bool:
    """``model.checkpoint_layers=auto`` under checkpointing: the count is chosen from the memory budget."""
    return bool(model_cfg.gradient_checkpointing) and str(model_cfg.checkpoint_layers) == "auto"


def predicted_run(cfg: RunConfig, task, tokenizer, world: int, sharded: bool, gpu_gib: float) -> tuple[Arch, Run]:
    """The shape and sizes ``bicc.machine.memory`` counts for this run on one of ``world`` GPUs of ``gpu_gib``: the configured
    model, its longest training prompt with the contexts' framing, the config's sizes, and under
    ``model.checkpoint_layers=auto`` the count of checkpointed layers that fits."""
    from bicc.trainer.validation import context_template_tokens, longest_training_prompt

    prompt = (longest_training_prompt(task, tokenizer, max_len=cfg.data.max_prompt_length)[0]
              + context_template_tokens(cfg.bicc, cfg.rollout.group_size, tokenizer))
    run = run_of(StepConfig.of(cfg), cfg.model, cfg.eval, cfg.dist, world, sharded, gpu_gib, prompt)
    arch = model_arch(cfg.model, len(tokenizer))
    if auto_layers(cfg.model):
        run = dataclasses.replace(run, checkpoint_layers=resolve_checkpoint_layers(arch, run, gpu_gib))
    return arch, run


def launch_check(train, model_cfg, predict, device) -> str | None:
    """Before any weights load: the run's predicted peak per GPU (``predict(gib)``: ``predicted_run`` on a GPU of
    ``gib``) against ``train.memory_gib`` (null: the CUDA device's total memory; on CPU nothing is checked); under
    ``model.checkpoint_layers=auto`` the count that fits is written into ``model_cfg``. Returns the line to print, or
    None; raises ValueError (naming the setting to lower) when it does not fit and ``train.memory_check`` is on."""
    import torch

    budget = train.memory_gib
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory / GIB
    auto = auto_layers(model_cfg)
    if budget is None or not (train.memory_check or auto):
        return None
    try:
        arch, run = predict(budget)
    except UncountedModel as err:  # what it cannot count it does not refuse: the run starts, told so
        line = f"warning: the memory check cannot count this model: {err}; not checked, the run starts"
        if auto:
            model_cfg.checkpoint_layers = "all"
            line += " with model.checkpoint_layers=auto read as all (every layer checkpointed)"
        return line
    if run.checkpoint_layers is not None and run.checkpoint_layers > arch.layers:
        raise ValueError(f"config field 'model.checkpoint_layers': {run.checkpoint_layers} layers, but the model has "
                         f"{arch.layers}")
    chosen = ""
    if auto:  # the model is loaded with this many layers checkpointed (bicc.model.load.enable_checkpointing)
        model_cfg.checkpoint_layers = str(run.checkpoint_layers)
        chosen = f"model.checkpoint_layers=auto: {run.checkpoint_layers} of {arch.layers} layers checkpointed; "
    return chosen + (check_fit(arch, run, budget) if train.memory_check else "memory check off")



def gate_copies(async_steps: int, every: int | None) -> int:
    from bicc.rollout.agreement import check_every, kept_versions

    return kept_versions(async_steps, check_every(every, async_steps))


def gate_host_bytes(arch: Arch, run: Run, async_steps: int, every: int | None) -> int:
    """Host bytes one training process holds for ``rollout/token_prob_ratio`` under rollout workers
    (``bicc.rollout.agreement.WeightVersions``): its share of the master weights (1/world under FSDP2), once for
    each version a checked step will read; under ``model.lora`` the adapters' alone (what trains)."""
    trains = arch.lora_params(run.lora_rank, run.lora_targets) if run.lora_rank else arch.params()
    share = trains * run.master_bytes // (run.world if run.sharded else 1)
    return gate_copies(async_steps, every) * share


def check_workers(rollout, train, predict, d, device, environ=None, device_count: int | None = None) -> list[str]:
    """Under ``rollout.async_steps``, before any weights load: the workers' devices (a GPU out of range, listed twice
    or a training rank's is refused, naming both: ``bicc.machine.layout.worker_places``), what the host lacks for the
    layout (warnings naming the fix), and each worker GPU's predicted peak (``predict(gib)``, as ``launch_check``'s)
    against ``train.memory_gib`` (null: the GPU's memory), beside a training rank's where it shares one; raises
    ValueError naming the knob when it does not fit. Returns the lines to print."""
    import os

    import torch

    from bicc.machine.layout import host_warnings, transport, worker_gpu, worker_places
    from bicc.machine.memory import peak as trainer_peak
    from bicc.rollout import ENGINES

    environ = os.environ if environ is None else environ
    cuda, r, engine = device.type == "cuda", rollout, ENGINES.get(rollout.engine)
    count = torch.cuda.device_count() if device_count is None and cuda else (device_count or 0)
    places = worker_places(r, d.world, cuda, environ, device_count=count)
    kind = transport(engine.weight_route, cuda, places)
    try:
        budget = train.memory_gib or (torch.cuda.get_device_properties(device).total_memory / GIB if cuda else 80.0)
        arch, run = predict(budget)
    except UncountedModel as err:
        return [f"warning: the memory check cannot count this model ({err}): the workers' GPUs are not checked"]
    trainers = int(environ.get("LOCAL_WORLD_SIZE", d.world))
    load = trainers * run.master_bytes * arch.params() + len(places) * run.compute_bytes * arch.params()
    gate = gate_host_bytes(arch, run, r.async_steps, train.sampler_check_every)
    lines = [f"warning: {w}" for w in host_warnings(kind, len(places), load, trainers * gate)]
    copies = gate_copies(r.async_steps, train.sampler_check_every)
    gate_line = (f"sampler check: {copies} host cop{'y' if copies == 1 else 'ies'} of each training process's share "
                 f"of the weights, {size(gate)} a process, {size(trainers * gate)} on this node "
                 "(train.sampler_check_every)")
    if not cuda or not train.memory_check or not places:
        return lines + [gate_line] * bool(gate)
    rows = min(r.batch_size, max(1, r.prompts_per_step * r.group_size // max(1, len(places) + r.remote_workers)))
    bucket = int(r.push_bucket_mib * 2**20)
    shared = any(p.shares for p in places)
    # as bicc.rollout.worker.worker_rollout gives it
    share = r.vllm.gpu_memory_utilization if shared else r.vllm.worker_gpu_memory_utilization
    worker = sum(worker_gpu(arch, dataclasses.replace(run, vllm_utilization=share), engine.samples_from_module, rows,
                            bucket).values())
    value = worker + (trainer_peak(arch, run)[1] if shared else 0)
    line = (f"rollout worker GPU: predicted {value / GIB:.1f} GiB of {budget:.1f} GiB ({r.engine}"
            + (", beside a training rank" if shared else "") + ")")
    if value > budget * GIB:
        knob = ((f"rollout.vllm.{'gpu' if shared else 'worker_gpu'}_memory_utilization (the engine's share)")
                if engine.reserves_memory_share else "rollout.batch_size")
        raise ValueError(f"config field 'rollout.devices': {line}: it does not fit. Lower {knob}"
                         + (", or give the workers GPUs of their own" if shared else "")
                         + "; or set train.memory_check=false to start anyway")
    return [*lines, line] + [gate_line] * bool(gate)


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / 2**20:.1f} MiB"


def preemption_check(train, model_cfg, tokenizer, d, environ=None, launcher: str | None = None,
                     params: int | None = None) -> list[str]:
    """At launch, where a limit is known (torchrun's ``--shutdown-timeout``, ``train.preemption_lead_s``): the
    predicted save of a preempted step against them (``bicc.machine.preemption.preemption_contract``), as lines to
    print, warnings first; ``launcher``: torchrun's command line (default: read from this process's parent);
    ``params``: the model's parameters (default: counted from its config)."""
    import os

    from bicc.machine.distributed import DTYPES
    from bicc.machine.preemption import checkpoint_bytes, launcher_grace, preemption_contract

    environ = os.environ if environ is None else environ
    grace, lead = launcher_grace(environ, launcher), train.preemption_lead_s
    if grace is None and lead is None:
        return []
    try:
        params = params or model_arch(model_cfg, len(tokenizer)).params()
    except UncountedModel as err:
        return [f"warning: the save of a preempted step is not predicted: {err}"]
    local = int(environ.get("LOCAL_WORLD_SIZE", d.world))
    save_bytes = checkpoint_bytes(params, DTYPES[model_cfg.dtype].itemsize, DTYPES[model_cfg.master_dtype].itemsize,
                                  d.world, local, d.enabled and d.strategy == "fsdp2")
    line, warnings = preemption_contract(save_bytes, train.checkpoint_write_gib_s, grace, lead, train.save_every)
    return [*(f"warning: {w}" for w in warnings), line]
