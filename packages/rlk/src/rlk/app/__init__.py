"""rlk's applications: the ``rlk`` command line (:mod:`rlk.app.cli`), ``rlk demo``, ``rlk info`` and the
rollout-vs-training consistency tooling (:mod:`rlk.app.consistency`)."""
