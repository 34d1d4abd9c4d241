"""A/B (session 8): the working tree's policy_loss_fwd against the previous commit's (tmp_ab/policy_loss_old.py):
every output bitwise. Run from the repository root: ``python3 tmp_ab/bits.py``."""

import importlib.util
import sys

import torch

sys.path.insert(0, "packages/rlk-triton/tests")
import test_policy_loss_kernels as t  # noqa: E402  (the kernel tests' input maker and forward caller)

from rlk_triton import policy_loss as new  # noqa: E402

spec = importlib.util.spec_from_file_location("policy_loss_old", "tmp_ab/policy_loss_old.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
cases = [
    dict(loss="ppo", agg="token-mean", dual_clip=3.0),
    dict(loss="ppo", agg="token-mean", global_tokens=1000.0),
    dict(loss="ppo", agg="seq-mean-token-mean"),
    dict(loss="gspo", agg="seq-mean-token-mean"),
    dict(loss="geo_mean", agg="token-mean", global_tokens=1000.0),
    dict(loss="cispo", agg="seq-mean-token-sum"),
]
bad = 0
for shape in ((512, 8192), (133, 3000), (7, 100)):
    inputs = t.make_inputs(*shape, seed=3, per_seq_adv=False)
    for kw in cases:
        a = t.run_fwd(new, inputs, **kw)
        b = t.run_fwd(old, inputs, **kw)
        same = {k: torch.equal(a[k], b[k]) for k in a}
        ok = all(same.values())
        bad += not ok
        print(shape, kw, "same bits" if ok else same, flush=True)
print("FAILED" if bad else "all same bits", bad)
