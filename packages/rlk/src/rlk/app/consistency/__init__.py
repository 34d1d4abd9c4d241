"""Consistency tooling: does a rollout engine and a trainer compute the same log-probs for the same tokens?

* :mod:`rlk.app.consistency.harness`: fixed standard Transformers (transformers' Qwen3 / Llama classes from a config,
  seeded weights), a fixed prompt set, fp64 reference log-probs;
* :mod:`rlk.app.consistency.paths`: the rollout-style and training-style execution paths and the rlk chain switch;
* :mod:`rlk.app.consistency.probe`: layer-wise drift probe; :mod:`rlk.app.consistency.run`: the ``rlk consistency``
  report.

transformers (and matplotlib for the chart) are optional: the submodules import them inside their functions.
"""

#: The built-in models of ``rlk consistency --model`` (besides a local checkpoint directory); here, not in
#: :mod:`~rlk.app.consistency.harness`, so that the command line parses without importing torch.
MODELS = ("tiny", "tiny-llama", "qwen3-8b-shape", "llama3-8b-shape")
