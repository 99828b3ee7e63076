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


def row_scale_exponent(max_abs_biased_exp):
    """Power of two (as an exponent) applied to a bf16 row, from the biased fp32 exponent of
    its largest |q| (0 for an all-zero row: then the row is kept as is)."""
    return (max_abs_biased_exp != 0) * (Q_TARGET_EXP - (max_abs_biased_exp - 127))
