"""tools/same_cubins.py: the path-derived symbol prefixes are masked, nothing else."""

from tools.same_cubins import masked


def test_only_nvcc_path_prefixes_are_masked():
    a = b"_ZN6fp8nca40_GLOBAL__N__34663732_8_merge_cu_c21b6695kernel _INTERNAL_dd937c5e_16_x"
    b = b"_ZN6fp8nca40_GLOBAL__N__5bad87c1_8_merge_cu_c21b6695kernel _INTERNAL_93a62358_16_x"
    assert a != b and masked(a) == masked(b)
    assert masked(a.replace(b"merge", b"merga")) != masked(b)  # other bytes still count
