"""Adapters from training frameworks to rlk's ops, each tested against the real package.

* :mod:`rlk.integrations.batch_invariant`: an unmodified model's aten ops routed to rlk's batch-invariant chain;
* :mod:`rlk.integrations.hf`: Hugging Face models (what the aten overrides cannot reach), the transformers range;
* :mod:`rlk.integrations.trl`: TRL's ``GRPOTrainer`` with rlk's log-probs, entropies and loss
  (:class:`~rlk.integrations.trl.RLKGRPOTrainer`), TRL's ``DPOTrainer`` with rlk's sequence log-probs and
  :func:`rlk.dpo_loss` (:class:`~rlk.integrations.trl.RLKDPOTrainer`);
* :mod:`rlk.integrations.verl`: rlk's policy losses, aggregation, KL, advantages and fused log-prob in verl's
  registries and calling conventions (:func:`~rlk.integrations.verl.register`);
* :mod:`rlk.integrations.vllm`: a vLLM plugin whose rollout log-probs are bitwise the trainer's, and weight sync
  (``docs/vllm.md``);
* :mod:`rlk.integrations.megatron`: megatron-core layer specs on rlk's chain (row-parallel linears on fixed K
  segments), a vocab-parallel head and an HF <-> Megatron weight converter (``docs/megatron.md``); FSDP2 and
  DeepSpeed ZeRO-3 need no adapter: :func:`rlk.integrations.hf.apply` on the sharded model (``docs/fsdp2.md``,
  ``docs/deepspeed.md``);
* :mod:`rlk.integrations.extras`: the extra of rlk that installs each optional dependency, and the error naming it.

``rlk.batch_invariant`` and ``rlk.patch_model`` import ``batch_invariant`` and ``hf`` on first use (neither needs
transformers to import); import ``trl``, ``verl``, ``vllm`` and ``megatron`` explicitly (``import
rlk.integrations.verl``): each needs its framework, installed by its extra.
"""
