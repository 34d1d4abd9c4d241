"""Adapters from training frameworks to rlk's ops, each tested against the real package.

* :mod:`rlk.integrations.trl`: TRL's ``GRPOTrainer`` with rlk's log-probs, entropies and loss
  (:class:`~rlk.integrations.trl.RLKGRPOTrainer`).

Each adapter imports its framework when the adapter's module is imported; this package imports none of them.
"""
