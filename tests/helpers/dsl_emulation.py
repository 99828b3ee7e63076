"""The driver both CUTLASS-DSL families' CPU emulations share (tcgen05 and wgmma): the whole
launch and its split merge around a family's own CTA emulation, a named case prepared and
compared with the reference, and the scenarios both families replay the same way. Each family's
test module keeps its own kernel logic (its CTA), its cases and its planted bugs."""

import dataclasses
import math
from collections import namedtuple
from collections.abc import Callable

import numpy as np
import torch

import fp8_noncausal_attn as fna
from dsl.common import indexing as X
from fp8_noncausal_attn.launch_record import LaunchInputs, launch_values
from fp8_noncausal_attn.synthetic import PagedCase, make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention
from helpers import TOLERANCE, replaced
from helpers.dsl import (
    extreme_scale_case,
    key_loaded_from_the_tile_start,
    poison_keys_before_windows,
    poison_pages_outside_windows,
    tiny_query_rows_case,
    window_begins_a_tile_early,
    worst_row_error,
)


def flat_bytes(cache: torch.Tensor) -> np.ndarray:
    """The whole storage of an FP8 cache as bytes, indexed by element offset + storage offset."""
    raw = cache.view(torch.uint8)
    return torch.as_strided(raw, (raw.untyped_storage().nbytes(),), (1,), 0).numpy()


def sink_log2(problem, head: int) -> float:
    """The sink of query head ``head`` in log2 units as the kernel reads it (the loader passes
    -inf, no sink, when the problem has none)."""
    if problem.sinks is None:
        return -math.inf
    return float(problem.sinks[head]) * math.log2(math.e)


def _select(cond, a, b):
    return a if cond else b


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the dtype names a traits.Variant takes."""
    return str(dtype).split(".")[1]


def reference(case: PagedCase, extra: dict) -> torch.Tensor:
    """The library's reference backend on ``case`` (``extra``: window, sinks)."""
    return fna.paged_attention(*case.args(), **case.kwargs(), **extra, backend="reference")


# One CTA's share of the launch, as dsl/common/work.py's CtaWork (which needs the DSL) holds it;
# ``first_tile`` and ``iters``: the key tiles it streams.
CtaWork = namedtuple(
    "CtaWork",
    ["group", "q_start", "q_len", "kv_len", "num_rows", "row_base", "last_row", "first_key",
     "first_tile", "iters", "causal"],
)  # fmt: skip


def _entry(tensor: torch.Tensor, offset: int) -> int:
    """The element ``offset`` elements past ``tensor``'s first one in its storage (a kernel's
    read of a pointer plus an offset), whatever the tensor's own strides."""
    return int(torch.as_strided(tensor, (offset + 1,), (1,))[offset])


def sequence_of(problem, seq: int, family: str) -> tuple[int, int, int, int]:
    """``(q_start, q_len, kv_len, causal)`` of sequence ``seq`` as a DSL kernel reads them
    (dsl/common/work.py cta_work, kernel_reads.read_causal_flag): each index tensor's storage at
    ``X.index_offset`` of the entry and the stride the launch passes (the launch record's
    values), the causal flag by the launch's ``causal_bytes``."""
    values = launch_values(family, LaunchInputs(problem, problem.query, 1))

    def cu(i):
        return _entry(problem.cu_seqlens_q, X.index_offset(i, values["cu_stride"]))

    kv_len = _entry(problem.seq_lens, X.index_offset(seq, values["sl_stride"]))
    causal = values["causal"]
    if values["causal_bytes"]:
        flags = problem.causal_per_seq
        assert flags.element_size() == values["causal_bytes"]
        causal = int(_entry(flags, X.index_offset(seq, values["causal_stride"])) != 0)
    return cu(seq), cu(seq + 1) - cu(seq), kv_len, causal


def cta_work(problem, family: str, rows: int, key_tile: int, seq: int, row_tile: int, split: int,
             num_splits: int) -> CtaWork | None:  # fmt: skip
    """What ``family``'s CTA of (``row_tile``, sequence ``seq``, split ``split``) with ``rows``
    query rows and key tiles of ``key_tile`` keys owns, replayed through the kernels' own index
    maps as dsl/common/work.py's cta_work makes it: its sequence's lengths and causal flag (read
    through the launch's strides, :func:`sequence_of`), its rows,
    and its key tiles from the first key its first row sees (window left) to the last key its
    last row sees (causal, window right), split ``split`` of ``num_splits``. None when the
    sequence has no row for it."""
    group = problem.num_q_heads // problem.num_kv_heads
    q_start, q_len, kv_len, causal = sequence_of(problem, seq, family)
    row_base = row_tile * rows
    num_rows = X.rows_per_kv_head(q_len, group)
    if not row_base < num_rows:
        return None
    left, right = problem.window
    last_row = min(row_base + rows, num_rows) - 1
    first_key = X.window_first_key(X.row_token(row_base, group), q_len, kv_len, left, _select,
                                   max)  # fmt: skip
    last_key = X.window_last_key(X.row_token(last_row, group), q_len, kv_len, causal, right,
                                 _select)  # fmt: skip
    begin, end = X.window_tiles(first_key, last_key, key_tile)
    first, end = X.split_tile_range(begin, end, num_splits, split, min)
    return CtaWork(group, q_start, q_len, kv_len, num_rows, row_base, last_row, first_key, first,
                   end - first, causal)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EmulatedFamily:
    """One DSL family's emulation as the shared scenarios drive it.

    ``emulate_cta(problem, variant, seq, row_tile, kv_head, split, num_splits, kbytes, vbytes)``
    returns {(token, head): (O row [head_dim] normalised and times v_scale, log2 LSE)} for the
    rows the CTA owns (``kbytes`` / ``vbytes``: flat_bytes of the caches). ``make_variant(
    head_dim, size, query dtype name, cache dtype name)`` is the family's traits.Variant, where
    ``size`` is the CTA's size knob that a case names as ``size_field`` (tcgen05: ``rows``,
    wgmma: ``consumers``; ``default_size`` when it names none). ``key_tile(variant)``: keys per
    tile. ``cases``: name -> fields of ``make_case`` plus splits, head_dim, window, sinks and
    ``size_field``, each built with ``seed``.
    """

    cases: dict[str, dict]
    emulate_cta: Callable
    make_variant: Callable
    size_field: str
    default_size: int
    key_tile: Callable
    seed: int

    def emulate(self, problem, variant, num_splits: int) -> torch.Tensor:
        """The whole launch (grid = row tiles x KV heads x sequences x splits) and the loader's
        merge: float64 [num_tokens, num_q_heads, head_dim]."""
        group = problem.num_q_heads // problem.num_kv_heads
        row_tiles = X.ceil_div(problem.max_seqlen_q * group, variant.rows)
        kbytes, vbytes = flat_bytes(problem.key_cache), flat_bytes(problem.value_cache)
        states = {}
        for seq in range(problem.num_seqs):
            for row_tile in range(row_tiles):
                for kv_head in range(problem.num_kv_heads):
                    for split in range(num_splits):
                        part = self.emulate_cta(
                            problem, variant, seq, row_tile, kv_head, split, num_splits, kbytes,
                            vbytes,
                        )  # fmt: skip
                        for key, state in part.items():
                            states.setdefault(key, []).append(state)
        out = torch.zeros(problem.query.shape, dtype=torch.float64)
        for (token, head), parts in states.items():
            if num_splits == 1:
                out[token, head] = torch.from_numpy(parts[0][0])
                continue
            # The loader's merge: weights 2^(lse - max), O already normalised; a sink (log2
            # units) joins the denominator once, here and not in any split.
            lse = np.array([p[1] for p in parts])
            sink = sink_log2(problem, head)
            top = max(lse.max(), sink)
            top = top if np.isfinite(top) else 0.0
            w = np.exp2(lse - top)
            acc = sum(wi * p[0] for wi, p in zip(w, parts, strict=True))
            total = w.sum() + np.exp2(sink - top)
            out[token, head] = torch.from_numpy(acc / total if total > 0 else acc * 0)
        return out

    def prepare(self, name: str):
        """(case, problem, variant, splits, extra reference kwargs: window, sinks) of
        ``cases[name]``; the problem as a launch gets it (checks skipped)."""
        spec = dict(self.cases[name])
        splits = spec.pop("splits")
        size = spec.pop(self.size_field, self.default_size)
        head_dim = spec.pop("head_dim", 128)
        extra = {"window": spec.pop("window", (-1, -1))}
        if "sinks" in spec:
            extra["sinks"] = torch.tensor(spec.pop("sinks"), dtype=torch.float32)
        q_lens, kv_lens = spec.pop("q_lens"), spec.pop("kv_lens")
        case = make_case(q_lens, kv_lens, head_dim=head_dim, seed=self.seed, **spec)
        problem = validate_attention(
            *case.args(), **case.kwargs(), **extra, softmax_scale=None, out=None, validate=False
        )
        q_dtype, cache_dtype = _dtype_name(case.query.dtype), _dtype_name(case.key_cache.dtype)
        variant = self.make_variant(head_dim, size, q_dtype, cache_dtype)
        return case, problem, variant, splits, extra

    def run_case(self, name: str) -> tuple[float, float]:
        """(relative error against the reference, SPEC tolerance) of ``cases[name]``'s
        emulated launch, whose output must not be all zeros (NaN from a planted bug passes
        that)."""
        case, problem, variant, splits, extra = self.prepare(name)
        out = self.emulate(problem, variant, splits).to(case.query.dtype)
        ref = reference(case, extra)
        n = int(case.cu_seqlens_q[-1])
        assert out[:n].abs().sum() != 0
        return relative_error(out[:n], ref[:n]), TOLERANCE[case.query.dtype]

    def check_planted_bug_is_caught(self, monkeypatch, module, attr: str, bug, name: str):
        """With ``module.attr`` replaced by ``bug``, ``cases[name]`` leaves the tolerance (NaN
        counts as caught, and so does an all-zero output, which :meth:`run_case` refuses)."""
        monkeypatch.setattr(module, attr, bug)
        try:
            error, tolerance = self.run_case(name)
        except AssertionError:  # the all-zero output of a launch the bug emptied
            return
        assert not error <= tolerance

    def poisoned_launch_stays_finite(self, name: str, poison: Callable):
        """``cases[name]`` after ``poison(problem, key_tile)`` (which returns how much it
        poisoned: more than none) stays finite and within tolerance of the unpoisoned
        reference; returns (problem, variant, splits, output rows) for the live checks."""
        case, problem, variant, splits, extra = self.prepare(name)
        ref = reference(case, extra)
        assert poison(problem, self.key_tile(variant)) > 0
        n = int(case.cu_seqlens_q[-1])
        out = self.emulate(problem, variant, splits).to(case.query.dtype)[:n]
        assert torch.isfinite(out).all()
        assert relative_error(out, ref[:n]) <= TOLERANCE[case.query.dtype]
        return problem, variant, splits, n

    def check_tiles_outside_every_window_are_never_read(self, name: str, monkeypatch):
        """``cases[name]`` with every page outside all of its rows' windows poisoned (FP8 NaN)
        stays finite and within tolerance; the poison is live: a launch that starts a tile
        early and loads its keys before the window (indexing.key_loaded keeps them out on its
        own), or ignores the window, reads it."""
        problem, variant, splits, n = self.poisoned_launch_stays_finite(
            name, poison_pages_outside_windows
        )
        monkeypatch.setattr(X, "window_tiles", window_begins_a_tile_early)
        monkeypatch.setattr(X, "key_loaded", key_loaded_from_the_tile_start)
        assert not torch.isfinite(self.emulate(problem, variant, splits)[:n]).all()
        monkeypatch.undo()
        unwindowed = replaced(problem, window=(-1, -1))
        assert not torch.isfinite(self.emulate(unwindowed, variant, splits)[:n]).all()

    def check_keys_before_the_window_in_its_first_tile_stay_out(self, name: str, monkeypatch):
        """``cases[name]`` with the slots before each window's first key (null pages, and the
        first key's page before it) and past each sequence's length holding FP8 NaN
        (poison_keys_before_windows) stays finite and within tolerance; the poison is live: a
        launch that loads the first tile's keys before the window (masking only their scores)
        turns NaN."""
        problem, variant, splits, n = self.poisoned_launch_stays_finite(
            name, poison_keys_before_windows
        )
        monkeypatch.setattr(X, "key_loaded", key_loaded_from_the_tile_start)
        assert not torch.isfinite(self.emulate(problem, variant, splits)[:n]).all()

    def extreme_case(self, size: int, query_exponent: int, key_exponent: int):
        """(case, extra reference kwargs, variant) of extreme_scale_case for the head_dim 128,
        bf16, e4m3 variant of CTA size ``size``: a row tile holds a quarter of its rows in
        tokens (GQA 4), seeded by its rows."""
        variant = self.make_variant(128, size, "bfloat16", "float8_e4m3fn")
        case, extra = extreme_scale_case(
            variant.rows // 4, query_exponent, key_exponent, seed=variant.rows
        )
        return case, extra, variant

    def launch(self, case: PagedCase, extra: dict, variant, splits: int):
        """(emulated, reference) output rows of ``case`` checked as the API checks it (``extra``:
        window, sinks), in the query's dtype."""
        problem = validate_attention(
            *case.args(), **case.kwargs(), **extra, softmax_scale=None, out=None, validate=True
        )
        n = int(case.cu_seqlens_q[-1])
        out = self.emulate(problem, variant, splits).to(case.query.dtype)[:n]
        return out, reference(case, extra)[:n]

    def check_tiny_and_zero_query_rows(self, size: int, splits: int):
        """tiny_query_rows_case (seeded by ``size``) on the head_dim 128 bf16 e4m3 variant of
        CTA size ``size``: every row finite and within tolerance of the reference."""
        case = tiny_query_rows_case(seed=size)
        variant = self.make_variant(128, size, "bfloat16", "float8_e4m3fn")
        out, ref = self.launch(case, {}, variant, splits)
        assert torch.isfinite(out).all()
        assert worst_row_error(out, ref) <= TOLERANCE[case.query.dtype]
