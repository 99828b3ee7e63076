"""What every DSL family's ``Variant`` (dsl/<family>/traits.py) shares: the dtypes built, the
variant's name (and that of a kernel serving both query dtypes), and the dtype check. Plain
Python (no DSL import).
"""

Q_DTYPES = ("bfloat16", "float16")
CACHE_DTYPES = ("float8_e4m3fn",)
# log2 of the page sizes (16..256) a kernel with a run-time page size takes (the C interface's
# ``block_shift``); a variant named without ``_p<N>`` runs all of them.
BLOCK_SHIFTS = (4, 5, 6, 7, 8)

_Q_TAGS = {"bfloat16": "bf16", "float16": "f16"}
_CACHE_TAGS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def variant_name(
    family: str, head_dim: int, rows_tag: str, page_size: int | None, q_dtype: str, cache_dtype: str
) -> str:
    """A variant's name (and exported symbol), e.g. ``tcgen05_d128_n32_p16_bf16_e4m3`` for a
    compile-time page size, ``wgmma_d128_m64_bf16_e4m3`` (``page_size`` None) for a kernel that
    takes the page size at run time (any of ``BLOCK_SHIFTS``)."""
    q, kv = _Q_TAGS[q_dtype], _CACHE_TAGS[cache_dtype]
    page = "" if page_size is None else f"_p{page_size}"
    return f"{family}_d{head_dim}_{rows_tag}{page}_{q}_{kv}"


def query_agnostic_name(family: str, head_dim: int, rows_tag: str, cache_dtype: str) -> str:
    """The name of a kernel that takes the query dtype at run time, e.g. ``tcgen05_d128_n32_e4m3``
    (the variants ``..._bf16_e4m3`` and ``..._f16_e4m3`` both run it)."""
    return f"{family}_d{head_dim}_{rows_tag}_{_CACHE_TAGS[cache_dtype]}"


def check_dtypes(
    q_dtype: str, cache_dtype: str, cache_dtypes: tuple[str, ...] = CACHE_DTYPES
) -> None:
    """Raise ValueError unless the query / KV dtypes are ones the family builds (``cache_dtypes``:
    the family's FP8 cache dtypes)."""
    if q_dtype not in Q_DTYPES or cache_dtype not in cache_dtypes:
        raise ValueError(f"dtypes {q_dtype}/{cache_dtype} not built")
