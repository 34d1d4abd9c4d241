"""Adapters from training frameworks to rlk's ops, each tested against the real package.

* :mod:`rlk.integrations.batch_invariant`: an unmodified model's aten ops routed to rlk's batch-invariant chain;
* :mod:`rlk.integrations.hf`: Hugging Face models (what the aten overrides cannot reach), the transformers range;
* :mod:`rlk.integrations.trl`: TRL's ``GRPOTrainer`` with rlk's log-probs, entropies and loss
  (:class:`~rlk.integrations.trl.RLKGRPOTrainer`), TRL's ``DPOTrainer`` with rlk's sequence log-probs and
  :func:`rlk.dpo_loss` (:class:`~rlk.integrations.trl.RLKDPOTrainer`);
* :mod:`rlk.integrations.verl`: rlk's policy losses, aggregation, KL, advantages and fused log-prob in verl's
  registries and calling conventions (:func:`~rlk.integrations.verl.register`);
* :mod:`rlk.integrations.extras`: the extra of rlk that installs each optional dependency, and the error naming it.

``rlk.batch_invariant`` and ``rlk.patch_model`` import ``batch_invariant`` and ``hf`` on first use (neither needs
transformers to import); import ``trl`` and ``verl`` explicitly (``import rlk.integrations.verl``): each imports its
framework when it is imported.
"""
