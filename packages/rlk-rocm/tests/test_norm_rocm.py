"""ROCm rms_norm primitives against the reference run in fp64 (contract tolerances), bitwise batch
invariance, determinism of the weight gradient, and the public op on the rocm backend.
Needs a GPU (marker ``gpu``); on an NVIDIA GPU (a CUDA torch) they are skipped.

The tests are rlk-cuda's (packages/rlk-cuda/tests/test_norm_cuda.py), run here with ``BACKEND = "rocm"``.
"""

from __future__ import annotations

from _shared_tests import load_cuda_tests

_shared = load_cuda_tests("test_norm_cuda")
globals().update({k: v for k, v in vars(_shared).items() if k.startswith("test_") or k == "pytestmark"})
