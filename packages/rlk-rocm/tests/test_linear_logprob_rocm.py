"""ROCm linear_logprob primitives (MFMA, float16 / bfloat16) against the reference run in fp64 (contract
tolerances), bitwise batch invariance (``torch.equal``), deterministic grad_weight, and the public op on the rocm
backend (float32 falls through). Needs an AMD GPU (markers ``gpu`` and ``rocm``: deselected elsewhere).

The tests are rlk-cuda's (packages/rlk-cuda/tests/test_linear_logprob_cuda.py), run here with ``BACKEND = "rocm"``:
the kernel bodies are the same (linear_logprob.cuh), over the MFMA core mma_amd.cuh instead of mma.sync.
"""

from __future__ import annotations

from _shared_tests import load_cuda_tests

_shared = load_cuda_tests("test_linear_logprob_cuda")
globals().update({k: v for k, v in vars(_shared).items() if k.startswith("test_") or k in ("pytestmark", "kernel")})
