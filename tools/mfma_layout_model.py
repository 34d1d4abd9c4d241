"""A line-by-line model of the data movement of rlk-rocm's MFMA GEMM core (packages/rlk-cuda/csrc/mma_amd.cuh),
checked against numpy's ``A @ B``: there is no AMD GPU to run the core on, so this is how its index arithmetic was
checked.

Modelled, with the formulas of mma_amd.cuh: ``fetch_tile`` (16-byte chunks global -> registers, K-major and MN-major,
zero chunks outside the operand), ``store_tile`` (registers -> the K-major LDS tile, ``swizzle``, the MN-major
transpose as 32-bit (k, k + 1) pairs), ``compute_stage`` (each lane's two 16-byte fragment reads per MFMA tile, the
four k-groups per K step, the B tile passed as the MFMA's source A) and the accumulator layout the epilogues read
(``slot_row`` / ``slot_col`` / ``acc_value``). ``v_mfma_f32_32x32x8`` is modelled from the ISA's operand layouts
(AMD Instinct MI200 / MI300 ISA; the AMD matrix instruction calculator prints the same): source A ``[32 x 8]``
element (i, k) in lane ``32 (k / 4) + i``, source B likewise with j, result D[i][j] in lane ``j + 32 ((i / 4) % 2)``,
register ``4 (i / 8) + i % 4``.

Checked: every element of the 128 x 128 block tile is held by exactly one (thread, value), values (n, 2q), (n, 2q + 1)
are adjacent columns, and the tile equals ``A @ B`` (integer data: exact) for every pair of operand layouts, with
ragged M, N and K. A model, not the kernel: a change to mma_amd.cuh must be mirrored here to stay checked.

    python3 tools/mfma_layout_model.py
"""

from __future__ import annotations

import numpy as np

BM = BN = 128  # block tile
BK = 32  # K step
THREADS = 256
WAVE = 64
WARPS_N = 2
WARP_M = WARP_N = 64
MT = NT = 2  # 32 x 32 MFMA tiles per wavefront along M, N


def swizzle(r: int, c: int) -> int:
    """Element offset of (row r, logical 16-byte chunk c) in an LDS tile: mma_amd.cuh's swizzle."""
    return r * BK + ((c ^ (((r >> 1) ^ (r >> 3)) & 3)) << 3)


def fetch_tile(op: dict, k_major: bool, mn0: int, k0: int) -> list[list[np.ndarray]]:
    """Each thread's two chunks of 8 values (fetch_tile)."""
    chunks = []
    for tid in range(THREADS):
        mine = []
        for i in range(2):
            if k_major:
                idx = tid + i * THREADS
                grow, gcol = mn0 + idx // (BK // 8), k0 + (idx % (BK // 8)) * 8
            else:
                grow, gcol = k0 + 2 * (tid // (BM // 8)) + i, mn0 + (tid % (BM // 8)) * 8
            v = np.zeros(8, dtype=np.int64)
            if grow < op["rows"] and gcol < op["cols"]:
                v = op["mat"][grow, gcol : gcol + 8].copy()
            mine.append(v)
        chunks.append(mine)
    return chunks


def store_tile(lds: np.ndarray, chunks, k_major: bool) -> None:
    """The chunks into the K-major LDS tile (store_tile)."""
    for tid in range(THREADS):
        v = chunks[tid]
        if k_major:
            for i in range(2):
                idx = tid + i * THREADS
                off = swizzle(idx // (BK // 8), idx % (BK // 8))
                lds[off : off + 8] = v[i]
        else:
            k, mn = 2 * (tid // (BM // 8)), (tid % (BM // 8)) * 8
            for e in range(8):
                off = swizzle(mn + e, k // 8) + k % 8
                lds[off], lds[off + 1] = v[0][e], v[1][e]  # the 32-bit pair: k low, k + 1 high


def mfma_32x32x8(src_a, src_b, c):
    """D = A B + C for one wavefront, from the per-lane operands (4 k values each) and accumulators (16 each)."""
    a = np.zeros((32, 8), dtype=np.int64)
    b = np.zeros((8, 32), dtype=np.int64)
    for lane in range(WAVE):
        for kk in range(4):
            a[lane % 32, 4 * (lane // 32) + kk] = src_a[lane][kk]
            b[4 * (lane // 32) + kk, lane % 32] = src_b[lane][kk]
    d = a @ b
    out = [acc.copy() for acc in c]
    for lane in range(WAVE):
        for r in range(16):
            out[lane][r] += d[8 * (r // 4) + 4 * (lane // 32) + r % 4][lane % 32]
    return out


def compute_stage(lds_a: np.ndarray, lds_b: np.ndarray, acc) -> None:
    """acc[wave][i][n] (64 lanes x 16 values) += the K step's product (compute_stage)."""
    for w in range(THREADS // WAVE):
        wm0, wn0 = w // WARPS_N * WARP_M, w % WARPS_N * WARP_N
        a = [[[None, None] for _ in range(MT)] for _ in range(WAVE)]
        b = [[[None, None] for _ in range(NT)] for _ in range(WAVE)]
        for lane in range(WAVE):
            r, c = lane % 32, 2 * (lane // 32)
            for q in range(2):
                for i in range(MT):
                    off = swizzle(wm0 + i * 32 + r, c + q)
                    a[lane][i][q] = lds_a[off : off + 8]
                for n in range(NT):
                    off = swizzle(wn0 + n * 32 + r, c + q)
                    b[lane][n][q] = lds_b[off : off + 8]
        for t in range(4):
            for i in range(MT):
                for n in range(NT):
                    af = [a[lane][i][t // 2][4 * (t % 2) : 4 * (t % 2) + 4] for lane in range(WAVE)]
                    bf = [b[lane][n][t // 2][4 * (t % 2) : 4 * (t % 2) + 4] for lane in range(WAVE)]
                    acc[w][i][n] = mfma_32x32x8(bf, af, acc[w][i][n])


def check(m: int, n: int, k: int, a_k_major: bool, b_k_major: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, 4, (m, k))
    b = rng.integers(-3, 4, (k, n))
    # global layouts: K-major A [M, K], MN-major A [K, M]; K-major B [N, K], MN-major B [K, N]
    op_a = dict(mat=a, rows=m, cols=k) if a_k_major else dict(mat=a.T.copy(), rows=k, cols=m)
    op_b = dict(mat=b.T.copy(), rows=n, cols=k) if b_k_major else dict(mat=b, rows=k, cols=n)

    def zero_tile():
        return [np.zeros(16, dtype=np.int64) for _ in range(WAVE)]

    acc = [[[zero_tile() for _ in range(NT)] for _ in range(MT)] for _ in range(THREADS // WAVE)]
    for k0 in range(0, k, BK):
        lds_a = np.zeros(BM * BK, dtype=np.int64)
        lds_b = np.zeros(BN * BK, dtype=np.int64)
        store_tile(lds_a, fetch_tile(op_a, a_k_major, 0, k0), a_k_major)
        store_tile(lds_b, fetch_tile(op_b, b_k_major, 0, k0), b_k_major)
        compute_stage(lds_a, lds_b, acc)
    got = np.zeros((BM, BN), dtype=np.int64)
    seen = np.zeros((BM, BN), dtype=int)
    for tid in range(THREADS):
        w, lane = tid // WAVE, tid % WAVE
        wm0, wn0 = w // WARPS_N * WARP_M, w % WARPS_N * WARP_N
        for i in range(MT):
            row = wm0 + i * 32 + lane % 32  # slot_row(i, 0)
            for nt in range(NT):
                for e in range(16):
                    col = wn0 + nt * 32 + 8 * (e // 4) + 4 * (lane // 32) + e % 4  # slot_col(nt, e)
                    assert e % 2 == 1 or col % 2 == 0
                    got[row, col] = acc[w][i][nt][lane][e]  # acc_value(acc, i, 0, nt, e)
                    seen[row, col] += 1
    assert (seen == 1).all(), "every element of the block tile is held exactly once"
    want = np.zeros((BM, BN), dtype=np.int64)
    want[:m, :n] = a @ b
    assert (got == want).all(), (m, n, k, a_k_major, b_k_major)


def main() -> None:
    shapes = [(128, 128, 64), (104, 72, 40), (8, 128, 8)]  # contiguous extents: multiples of 8, as the core needs
    for a_k_major in (True, False):
        for b_k_major in (True, False):
            for m, n, k in shapes:
                check(m, n, k, a_k_major, b_k_major, seed=m + n + k)
    print(f"mma_amd.cuh model: {4 * len(shapes)} cases equal to A @ B")


if __name__ == "__main__":
    main()
