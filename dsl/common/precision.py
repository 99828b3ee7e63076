"""Exact bf16 -> fp16 query scaling, shared by the DSL families whose MMAs run in fp16.

A bf16 query row is multiplied by 2^(Q_TARGET_EXP - e), e the exponent of the row's largest |q|,
which puts the largest element in [2^15, 2^16); bf16's 8 significant bits keep it below
65280 <= 65504 (fp16 max). Every element >= 2^-17 after scaling (fp16 subnormals hold 8
significant bits down to there) is exact: elements smaller than 2^-32 of the row's largest may
round, by less than 2^-25 of the scaled unit, far under the fp32 error of the dot products. The
factor 2^(e - Q_TARGET_EXP) rejoins the row's softmax scale. tests/test_wgmma_host.py checks
the exactness; both families' kernels and emulations use this function.
"""

Q_TARGET_EXP = 15
# A row whose largest |q| is below 2^-111 would need e > 126: 2^e overflows fp32 past 127 and
# 2^-e (the factor that rejoins the softmax scale) is subnormal past 126. Such a row is scaled by
# 2^126 only; its largest element lands in [2^0, 2^15), its scores are ~0 (a near-uniform
# softmax), and the elements it loses to fp16's range are under 2^-24 of the largest.
MAX_ROW_SCALE_EXP = 126


def row_scale_exponent(max_abs_biased_exp, minimum):
    """Power of two (as an exponent) applied to a bf16 row, from the biased fp32 exponent of
    its largest |q| (0 for an all-zero row: then the row is kept as is), at most
    MAX_ROW_SCALE_EXP so that 2^e and 2^-e are normal fp32. ``minimum``: the caller's min
    (cutlass.min in a kernel, np.minimum on arrays, min on ints)."""
    exponent = Q_TARGET_EXP - (max_abs_biased_exp - 127)
    return (max_abs_biased_exp != 0) * minimum(exponent, MAX_ROW_SCALE_EXP)


# Floor of a row's log2-domain score scale (softmax scale x k_scale x 2^-e, fp32), the smallest
# normal fp32. scales.check_score_scale keeps softmax scale x k_scale normal, but its product with
# a row's 2^-e can underflow to 0, and a masked score (-inf) or a no-key row maximum (-inf) times
# 0 is NaN. Raising such a scale to 2^-126 changes no result: |scores| < 2^33 (fp16 query
# <= 65280, fp8 key <= 57344, head_dim <= 256), so every score x scale stays below 2^-93, where
# the softmax is uniform to fp32 either way.
MIN_SCORE_SCALE = 2.0**-126
