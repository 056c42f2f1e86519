"""Evaluation: pass@k on benchmarks sharded over ranks (evaluate), bootstrap statistics (stats), paired
comparisons of two result dirs (compare) and the figures of a run's dynamics (plots). Imports ``bicc.rollout`` and
below; used by the trainer."""
