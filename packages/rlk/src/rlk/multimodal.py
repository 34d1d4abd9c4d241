"""``rlk.multimodal``: the public name of :mod:`rlk.integrations.multimodal` (multimodal RL batches: the span
schema, synthetic fixtures, modality-aware packing, the offline Qwen2-VL processor and the layout checker)."""

from rlk.integrations.multimodal import *  # noqa: F403
from rlk.integrations.multimodal import __all__  # noqa: F401
