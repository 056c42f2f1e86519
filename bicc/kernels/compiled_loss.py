"""The registered losses through ``torch.compile`` where the decoder layers run compiled (``model.compile``,
``bicc.kernels.compile``): eager, a loss and its metrics are a hundred small ops per micro-batch. Same signature as
registered; a loss whose compilation fails warns once and runs as registered from then on."""

from __future__ import annotations

import types
import warnings

import torch

from bicc.kernels.compile import compile_error_cause, compile_errors, decoder_layers
from bicc.method.losses import LOSSES, StepTotals


def loss_function(model, name: str):
    """The registered loss ``name`` (``bicc.method.losses.LOSSES``), compiled with the backend of ``model``'s decoder
    layers where they run compiled, else as registered; same signature either way."""
    fn = LOSSES.get(name)
    layer = next((m for m in decoder_layers(model) if getattr(m, "_bicc_compile_ok", False)), None)
    if layer is None or getattr(fn, "micro_batch_statistics", False):  # data-dependent selection: a graph break
        return fn
    if (fn, layer._bicc_backend) not in _LOSSES:
        _LOSSES[fn, layer._bicc_backend] = _CompiledLoss(fn, layer._bicc_backend)
    return _LOSSES[fn, layer._bicc_backend]


_LOSSES: dict = {}  # (loss, backend) -> its _CompiledLoss: one per process, whatever the number of updates


def _with_totals(fn, logp, old_logp, ref_logp, adv, mask, cfg, tokens, seqs, max_len, is_weight):
    return fn(logp, old_logp, ref_logp, adv, mask, cfg, StepTotals(tokens, seqs, max_len), is_weight=is_weight)


class _CompiledLoss:
    """A registered loss through ``torch.compile`` (dynamic shapes), with its eager fallback."""

    def __init__(self, fn, backend):
        self.fn, self.ok, self.plain = fn, True, {}
        self.compiled = torch.compile(_with_totals, dynamic=True, backend=backend)

    def _plain(self, cfg):
        """``cfg`` (an OmegaConf node) as a namespace of its values, the same object for the same values: the
        graph reads them as constants and guards on the object."""
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(cfg, DictConfig):
            return cfg
        values = OmegaConf.to_container(cfg, resolve=True)
        key = repr(sorted(values.items()))
        return self.plain.setdefault(key, types.SimpleNamespace(**values))

    def __call__(self, logp, old_logp, ref_logp, adv, mask, cfg, totals, is_weight=None):
        if self.ok:
            try:
                return self.compiled(self.fn, logp, old_logp, ref_logp, adv, mask, self._plain(cfg), totals.tokens,
                                     totals.seqs, totals.max_len, is_weight)
            except compile_errors() as error:
                self.ok = False
                warnings.warn(f"model.compile: the loss {self.fn.__name__} did not compile "
                              f"({compile_error_cause(error)}); it runs eagerly from here on", stacklevel=2)
        return self.fn(logp, old_logp, ref_logp, adv, mask, cfg, totals, is_weight=is_weight)
