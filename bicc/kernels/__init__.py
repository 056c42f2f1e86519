"""What makes the update fast, same numbers: padding-free packing, micro-batches, shared-prefix KV reuse, the
update's rows, compiled layers and loss, fused optimizer steps. Imports ``bicc.method`` and below; used by
rollout, evaluation and the trainer."""
