"""datasketch's MinHash parameters computed with numpy alone: the affine32 permutations and
MinHashLSH's banding. datasketch imports scipy (for the banding's integrals), ~1-2 CPU-s a
process, which every dedup_signatures job paid for a few arrays; these give the same values
(tests/test_dedup.py compares them with datasketch 2.x, which stays a test dependency).
"""

from __future__ import annotations

import numpy as np


def affine32_permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of datasketch's ``affine32`` scheme (``MinHash(num_perm, seed).permutations``):
    odd multipliers and offsets drawn from numpy's legacy ``RandomState`` (its stream is
    frozen by numpy's compatibility policy, so the draws do not change with numpy)."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


def lsh_bands(threshold: float, num_perm: int, weights: tuple[float, float]) -> tuple[int, int]:
    """(bands, rows per band) that datasketch's ``MinHashLSH(threshold, num_perm, weights)``
    picks: the pair minimising the weighted false positive and false negative areas under
    the banding's S-curve. Each area is the integral of a polynomial of degree at most
    ``num_perm``, which Gauss-Legendre with ``num_perm // 2 + 1`` nodes computes exactly
    (datasketch uses scipy's adaptive quadrature: the same values to ~1e-15).

    ValueError (datasketch's conditions) when it cannot band: fewer than 2 permutations or
    fewer than 2 bands."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError("threshold must be in [0.0, 1.0]")
    if num_perm < 2:
        raise ValueError("too few permutation functions (num_perm < 2)")
    fp_weight, fn_weight = weights
    x, w = np.polynomial.legendre.leggauss(num_perm // 2 + 1)
    below, below_w = threshold / 2 * (x + 1), threshold / 2 * w  # nodes on [0, threshold]
    above, above_w = threshold + (1 - threshold) / 2 * (x + 1), (1 - threshold) / 2 * w  # on [threshold, 1]
    best, chosen = float("inf"), (0, 0)
    for bands in range(1, num_perm + 1):  # datasketch's order: the first minimum wins a tie
        for rows in range(1, num_perm // bands + 1):
            false_pos = float(np.dot(below_w, 1 - (1 - below ** float(rows)) ** float(bands)))
            false_neg = float(np.dot(above_w, (1 - above ** float(rows)) ** float(bands)))
            error = false_pos * fp_weight + false_neg * fn_weight
            if error < best:
                best, chosen = error, (bands, rows)
    if chosen[0] < 2:
        raise ValueError("the number of bands is too small (b < 2)")
    return chosen
