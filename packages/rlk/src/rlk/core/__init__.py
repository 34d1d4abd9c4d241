"""rlk's core layer: the op ABI and its vocabulary, the backend interface, dispatch, the custom-op declaration
helper, argument checks, the numerical contract and the tensor-parallel switch.

Nothing here imports from :mod:`rlk.ops`, :mod:`rlk.integrations` or :mod:`rlk.app`; backends (``rlk_triton``,
``rlk_cuda``, :mod:`rlk.reference`) import only from here.
"""
