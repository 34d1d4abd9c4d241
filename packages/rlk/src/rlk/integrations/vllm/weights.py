"""Weight sync into a running in-process vLLM engine, and the weight checksums both sides compare.

The trainer holds a transformers state dict (names ``model.layers.0.self_attn.q_proj.weight``...; an FSDP2 model's
full one from ``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
options=StateDictOptions(full_state_dict=True))``, DTensors are gathered here with ``full_tensor()``). vLLM stacks
some of them: ``qkv_proj = cat(q_proj, k_proj, v_proj)`` and ``gate_up_proj = cat(gate_proj, up_proj)`` along the
output dim. :func:`vllm_state_dict` maps one onto the other; :func:`sync_weights` hands the trainer's tensors to the
engine's own ``model.load_weights`` and then checks that every parameter the engine holds is bitwise the mapped
trainer tensor (SHA-256 of the bytes, computed where the engine runs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor

#: transformers projection -> (vLLM stacked parameter, position in the stack)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _full(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)  # a DTensor (FSDP2): gathered
    return (full() if callable(full) else tensor).detach()


def vllm_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A transformers Qwen3 / Llama state dict under vLLM's parameter names (stacked projections concatenated along
    dim 0 in vLLM's order), on the CPU. Rotary buffers are dropped."""
    stacks: dict[str, dict[int, Tensor]] = {}
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        target = _STACKED.get(parts[-2]) if len(parts) >= 2 else None
        if target is None:
            out[name] = _full(tensor).cpu()
            continue
        stacked = ".".join([*parts[:-2], target[0], parts[-1]])
        stacks.setdefault(stacked, {})[target[1]] = _full(tensor).cpu()
    for name, pieces in stacks.items():
        expected = 3 if name.split(".")[-2] == "qkv_proj" else 2
        if sorted(pieces) != list(range(expected)):
            raise ValueError(f"state_dict: {name} needs {expected} projections, got positions {sorted(pieces)}")
        out[name] = torch.cat([pieces[i] for i in range(expected)], dim=0)
    return out


def tensor_checksum(tensor: Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (contiguous, on the CPU): equal checksums = bitwise equal."""
    t = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def weight_checksums(state: Mapping[str, Tensor]) -> dict[str, str]:
    """``{name: tensor_checksum}`` of a state dict (already under vLLM's names: see :func:`vllm_state_dict`)."""
    return {name: tensor_checksum(_full(t)) for name, t in state.items()}


def engine_checksums(llm) -> dict[str, str]:
    """``{vLLM parameter name: checksum}`` of the weights a running engine holds (its first worker)."""
    return llm.apply_model(lambda model: weight_checksums(dict(model.named_parameters())))[0]


def compare_checksums(trainer: Mapping[str, str], engine: Mapping[str, str]) -> dict:
    """Per-name comparison: ``{"ok", "equal", "different", "only_trainer", "only_engine"}``. A tied LM head (no
    ``lm_head.weight`` on the engine side, the trainer's equal to the embedding) is not a difference."""
    only_trainer = sorted(set(trainer) - set(engine))
    if "lm_head.weight" in only_trainer and trainer["lm_head.weight"] == trainer.get("model.embed_tokens.weight"):
        only_trainer.remove("lm_head.weight")
    different = sorted(name for name in set(trainer) & set(engine) if trainer[name] != engine[name])
    only_engine = sorted(set(engine) - set(trainer))
    equal = len(set(trainer) & set(engine)) - len(different)
    ok = not (different or only_trainer or only_engine)
    return {"ok": ok, "equal": equal, "different": different, "only_trainer": only_trainer, "only_engine": only_engine}


def sync_weights(llm, state_dict: Mapping[str, Tensor], *, check: bool = True) -> dict:
    """Copy the trainer's ``state_dict`` (transformers names) into the running engine ``llm`` (a ``vllm.LLM`` whose
    model runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) through its model's ``load_weights``; with
    ``check``, verify that every engine parameter is bitwise the trainer's tensor (:func:`compare_checksums`).

    Returns the comparison dict plus ``"loaded"`` (the names ``load_weights`` reported). Raises ``ValueError`` when
    the check fails (naming the first differing tensors). The engine must keep its weights as parameters (the
    plugin's linear layers do; vLLM's own CPU GEMMs repack them at load time)."""
    items = [(name, _full(t)) for name, t in state_dict.items() if "rotary_emb" not in name]
    loaded = llm.apply_model(lambda model: sorted(model.load_weights(iter(items)) or []))[0]
    result = {"loaded": loaded}
    if check:
        result.update(compare_checksums(weight_checksums(vllm_state_dict(state_dict)), engine_checksums(llm)))
        if not result["ok"]:
            bad = (result["different"] + result["only_trainer"] + result["only_engine"])[:5]
            raise ValueError(f"sync_weights: the engine's weights are not the trainer's: {bad}")
    return result
