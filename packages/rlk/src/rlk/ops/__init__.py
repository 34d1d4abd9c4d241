"""rlk's public ops, one module per op family (``rlk.ops.norm`` holds ``rms_norm``): argument checks, the
custom-op declarations and autograd; the kernels are the backends'. ``rlk`` re-exports every public function.
"""
