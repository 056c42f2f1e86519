"""What makes the update fast, same numbers: padding-free packing, micro-batches, shared-prefix KV reuse, the
update's rows, compiled layers and loss, fused optimizer steps. Imports ``bicc.method`` and below; used by
rollout, evaluation and the trainer.

Modules: ``packing`` (BiCC's contexts packed without padding), ``batching`` (micro-batches by rows or tokens, log-probs
without grad), ``prefix_cache`` (a shared prompt's KV, reused), ``rows`` (the update's rows), ``compile`` (compiled
decoder layers), ``compiled_loss`` (the registered losses through ``torch.compile``), ``fuse`` (fused optimizer
steps)."""
