"""What every DSL family's ``Variant`` (dsl/<family>/traits.py) shares: the dtypes built, the
variant's name, and the page-size and dtype checks. Plain Python (no DSL import).
"""

Q_DTYPES = ("bfloat16", "float16")
KV_DTYPES = ("float8_e4m3fn",)

_Q_TAGS = {"bfloat16": "bf16", "float16": "f16"}
_KV_TAGS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def variant_name(
    family: str, head_dim: int, rows_tag: str, page_size: int, q_dtype: str, kv_dtype: str
) -> str:
    """A variant's name (and exported symbol), e.g. ``wgmma_d128_m64_p16_bf16_e4m3``."""
    q, kv = _Q_TAGS[q_dtype], _KV_TAGS[kv_dtype]
    return f"{family}_d{head_dim}_{rows_tag}_p{page_size}_{q}_{kv}"


def check_page_and_dtypes(
    page_size: int, q_dtype: str, kv_dtype: str, kv_dtypes: tuple[str, ...] = KV_DTYPES
) -> None:
    """Raise ValueError unless the page size is a power of two in 16..256 and the query / KV
    dtypes are ones the family builds (``kv_dtypes``: the family's FP8 cache dtypes)."""
    if page_size & (page_size - 1) or not 16 <= page_size <= 256:
        raise ValueError(f"page_size {page_size}: a power of two in 16..256")
    if q_dtype not in Q_DTYPES or kv_dtype not in kv_dtypes:
        raise ValueError(f"dtypes {q_dtype}/{kv_dtype} not built")
