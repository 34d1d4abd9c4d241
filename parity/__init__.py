"""rlk's cross-backend parity suite: every available backend against the reference
run in fp64, under the numerical contract (``rlk.core.contract``), plus batch invariance.

Run it with ``python -m parity`` from the repository root (see ``README.md``).
"""
