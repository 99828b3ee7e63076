"""The benchmark suite: its CPU dry run end to end, and the pieces its numbers rest on."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import accuracy, shapes, vllm_peer
from benchmarks.accuracy import fp8_query_route
from benchmarks.inputs import gathered_kv, make_case
from benchmarks.oracle import attention_oracle
from fp8_noncausal_attn.synthetic import relative_error

REPO = Path(__file__).resolve().parent.parent
ROW_FIELDS = {
    "backend": str,
    "kv_cache_dtype": str,
    "causal": bool,
    "batch": int,
    "q_len": int,
    "kv_len": int,
    "num_q_heads": int,
    "num_kv_heads": int,
    "head_dim": int,
    "median_us": float,
    "bytes": int,
    "gbps": float,
    "tflops": float,
    "rel_err": float,
    "speedup": dict,
}
PER_TOKEN_HEAD = ("fp8_per_token_head", "int8_per_token_head")
BACKENDS = {
    "mma_sync",
    "wgmma",
    "tcgen05",
    "triton",
    "reference",
    "vllm_triton_unified",
    "fa3_fp8_query",
    "torch_sdpa",
    "flex_attention",
    "flashinfer",
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.attention", "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = out.glob("*.json")
    return json.loads(result.read_text()), result, done.stdout


def test_dry_run_json_schema(dry_run):
    payload, _, _ = dry_run
    assert payload["gpu"] == "cpu"
    assert payload["copy_bw_gbps"] is None
    assert payload["timings_meaningful"] is False
    assert "NOT meaningful" in payload["timing_note"]
    assert set(payload["backends"]) <= BACKENDS
    assert payload["rows"], "the dry run measured nothing"
    for row in payload["rows"]:
        for field, kind in ROW_FIELDS.items():
            assert isinstance(row[field], kind), (field, row)
        assert row["backend"] in BACKENDS
        assert row["frac_of_copy_bw"] is None
        assert row["frac_of_tensor_peak"] is None  # no tensor peak on record for a CPU
        assert row["bytes"] > 0 and row["median_us"] > 0
    assert payload["dense_16bit_tflops"] is None and payload["dense_16bit_source"] is None


def test_dry_run_covers_the_sweep_axes_and_the_cpu_backends(dry_run):
    payload, _, _ = dry_run
    rows = payload["rows"]
    assert {row["causal"] for row in rows} == {True, False}
    assert {row["kv_cache_dtype"] for row in rows} == {"fp8_e4m3", "float16", *PER_TOKEN_HEAD}
    assert {row["kind"] for row in rows} == {"drafter", "prefill"}
    assert len({row["q_len"] for row in rows if row["kind"] == "drafter"}) >= 2
    measured = {row["backend"] for row in rows}
    assert {"reference", "triton", "torch_sdpa", "flex_attention"} <= measured
    if all((vllm_peer.PEER_DIR / f).is_file() for f in vllm_peer.KERNEL_FILES):
        assert "vllm_triton_unified" in measured
    else:
        assert "fetch_peers.sh" in payload["backends"]["vllm_triton_unified"]["status"]
    assert payload["backends"]["flashinfer"]["status"] != "ok"


def test_dry_run_reads_the_per_token_head_pages_with_ours_and_vllms_kernel(dry_run):
    """Both per-token-head formats have rows of ours and of TRITON_ATTN's kernel (where its
    files are here) on the same shapes, and their bytes count the inline scales."""
    payload, result, _ = dry_run
    expected = {"reference", "triton"}
    if all((vllm_peer.PEER_DIR / f).is_file() for f in vllm_peer.KERNEL_FILES):
        expected.add("vllm_triton_unified")
    for kv_cache_dtype in PER_TOKEN_HEAD:
        rows = [row for row in payload["rows"] if row["kv_cache_dtype"] == kv_cache_dtype]
        assert expected <= {row["backend"] for row in rows}, kv_cache_dtype
        for row in rows:
            shape = shapes.Shape(**{**row_shape_fields(row), "window": tuple(row["window"])})
            per_head = dataclasses.replace(shape, kv_cache_dtype="fp8_e4m3")
            scales = shape.batch * shape.keys_read * shape.num_kv_heads * 8
            assert row["bytes"] == shape.bytes == per_head.bytes + scales
    assert f"Bytes: {shapes.BYTES_NOTE}." in result.with_suffix(".md").read_text()


def test_dry_run_outputs_match_the_oracle(dry_run):
    payload, _, _ = dry_run
    for row in payload["rows"]:
        assert math.isfinite(row["rel_err"]) and row["rel_err"] < 5e-3, row
        assert row["within_tolerance"] is True


def test_dry_run_speedups_cover_every_peer_on_the_shape(dry_run):
    payload, _, _ = dry_run
    ours = {"mma_sync", "wgmma", "tcgen05", "triton", "reference"}
    by_shape: dict[tuple, list[dict]] = {}
    for row in payload["rows"]:
        key = tuple(
            row[k] for k in ("kind", "batch", "q_len", "kv_len", "causal", "kv_cache_dtype")
        )
        by_shape.setdefault(key, []).append(row)
    for rows in by_shape.values():
        peers = {row["backend"]: row["median_us"] for row in rows if row["backend"] not in ours}
        for row in rows:
            if row["backend"] in ours:
                assert set(row["speedup"]) == set(peers)
                for peer, speedup in row["speedup"].items():
                    assert speedup == pytest.approx(peers[peer] / row["median_us"])
            else:
                assert row["speedup"] == {}


def test_dry_run_accuracy_study(dry_run):
    payload, _, _ = dry_run
    entries = payload["accuracy"]
    routes = {(e["route"], e["kv_len"]) for e in entries if e["route"] in accuracy.FP8_QUERY_ROUTES}
    kv_lens = {e["kv_len"] for e in entries}
    assert routes == {(r, n) for r in accuracy.FP8_QUERY_ROUTES for n in kv_lens}
    best = accuracy.best_fp8_query_errors(entries)
    ours = [e for e in entries if e["route"] not in accuracy.FP8_QUERY_ROUTES]
    assert ours
    for entry in ours:
        assert entry["rel_err"] < 5e-3, entry
        # FP8 rounding of Q and P must show in the emulated routes, or they emulate nothing.
        assert best[entry["kv_len"]] > 10 * entry["rel_err"]


def test_dry_run_writes_markdown_and_plots(dry_run):
    payload, result, stdout = dry_run
    stem = result.with_suffix("")
    markdown = stem.with_suffix(".md").read_text()
    assert "NOT meaningful" in markdown
    assert markdown.count("| drafter ") + markdown.count("| prefill ") >= len(payload["rows"])
    assert "## Accuracy" in markdown
    for suffix in ("-gbps.png", "-speedup.png"):
        png = Path(f"{stem}{suffix}")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(png) in stdout


def test_quick_preset_holds_the_acceptance_shape():
    acceptance = shapes.Shape(
        kind="drafter",
        batch=32,
        q_len=8,
        kv_len=8192,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        causal=False,
        kv_cache_dtype="fp8_e4m3",
    )
    assert acceptance in shapes.quick()


def test_full_preset_is_unique_and_within_the_memory_cap():
    full = shapes.full()
    assert len(full) == len(set(full))
    assert all(s.kv_bytes(itemsize=2) <= shapes.MAX_BF16_KV_BYTES for s in full)
    assert {s.head_dim for s in full} == {64, 128, 256}
    assert {s.q_len for s in full if s.kind == "drafter"} == {1, 8, 16}
    assert max(s.kv_len for s in full) == 131072
    assert {s.q_len for s in full if s.kind == "prefill"} == {4096, 8192, 16384}


def test_per_token_head_bytes_count_eight_scale_bytes_per_key_and_kv_head():
    fp8 = shapes.quick()[0]
    for kv_cache_dtype in PER_TOKEN_HEAD:
        shape = dataclasses.replace(fp8, kv_cache_dtype=kv_cache_dtype)
        keys = 32 * 8192 * 8  # batch x keys x KV heads
        assert shape.kv_bytes() == keys * (2 * 128 + 8) == fp8.kv_bytes() * (1 + 4 / 128)
        assert shape.bytes - fp8.bytes == keys * 8 and shape.flops == fp8.flops
        # The dequantised copy a peer builds has no scales.
        assert shape.kv_bytes(itemsize=2) == fp8.kv_bytes(itemsize=2)
    assert "8 bytes per key and KV head" in shapes.BYTES_NOTE and "3.1%" in shapes.BYTES_NOTE


def test_grid_measures_the_fp8_rows_first_then_the_same_shapes_per_token_head():
    grid = shapes.grid()
    fp8 = [shape for shape in grid if shape.kv_cache_dtype == "fp8_e4m3"]
    assert grid[: len(fp8)] == fp8 and len(fp8) == 16
    rest = grid[len(fp8) :]
    assert [shape.kv_cache_dtype for shape in rest] == list(PER_TOKEN_HEAD) * len(fp8)
    assert [
        dataclasses.replace(s, kv_cache_dtype="fp8_e4m3") for s in rest[:: len(PER_TOKEN_HEAD)]
    ] == fp8
    for preset in (shapes.quick, shapes.full):
        acceptance = preset()[0]
        for kv_cache_dtype in PER_TOKEN_HEAD:
            assert dataclasses.replace(acceptance, kv_cache_dtype=kv_cache_dtype) in preset()


def test_byte_and_flop_counts():
    shape = shapes.quick()[0]
    kv = 2 * 32 * 8192 * 8 * 128  # K and V, one byte each
    q_and_out = 2 * (32 * 8) * 32 * 128 * 2
    assert shape.bytes == kv + q_and_out
    assert shape.flops == 4 * 32 * 8 * 8192 * 32 * 128
    prefill = shapes.Shape("prefill", 1, 64, 64, 2, 1, 64, True, "bfloat16")
    assert prefill.flops == 4 * (64 * 65 // 2) * 2 * 64


def test_case_has_distinct_per_head_scales_and_shuffled_pages():
    shape = shapes.dry_run()[1]
    case = make_case(shape, torch.device("cpu"))
    assert float(case.k_scale.max() / case.k_scale.min()) > 1.5
    assert not torch.equal(case.k_scale, case.v_scale)
    flat = case.block_table.flatten()
    assert not torch.equal(flat, torch.arange(flat.numel(), dtype=flat.dtype))
    stored = case.key_cache.float()
    assert (stored == 0).float().mean() < 0.01 and stored.std() > 10


def test_oracle_matches_sdpa_on_the_gathered_copy_and_needs_per_head_scales():
    shape = shapes.dry_run()[2]  # causal
    case = make_case(shape, torch.device("cpu"), seed=3)
    key, value = gathered_kv(case, torch.float64)
    query = case.query.double().view(shape.batch, shape.q_len, shape.num_q_heads, -1)
    group = shape.num_q_heads // shape.num_kv_heads
    scores = (
        torch.einsum("bqhd,bhkd->bhqk", query, key.repeat_interleave(group, dim=1))
        * case.softmax_scale
    )
    offset = shape.kv_len - shape.q_len
    allowed = torch.arange(shape.kv_len)[None, :] <= torch.arange(shape.q_len)[:, None] + offset
    scores = scores.masked_fill(~allowed, float("-inf"))
    expected = torch.einsum(
        "bhqk,bhkd->bqhd", scores.softmax(-1), value.repeat_interleave(group, dim=1)
    ).flatten(0, 1)
    assert relative_error(attention_oracle(case, torch.float64), expected) < 1e-12
    scalar = case.k_scale.max().expand(shape.num_kv_heads)
    dropped = attention_oracle(case, torch.float64, k_scale=scalar)
    assert relative_error(dropped, expected) > 0.05


@pytest.mark.parametrize("q_scale", accuracy.FP8_QUERY_ROUTES.values())
@pytest.mark.parametrize("index", [1, 2, 3])  # bidirectional, causal, q_len 1
def test_fp8_query_route_error_comes_from_fp8_rounding_alone(index, q_scale, monkeypatch):
    shape = dataclasses.replace(shapes.dry_run()[index], kv_len=300)  # three key tiles
    case = make_case(shape, torch.device("cpu"), seed=5)
    exact = attention_oracle(case, torch.float64)
    assert 1e-3 < relative_error(fp8_query_route(case, q_scale), exact) < 0.2
    monkeypatch.setattr(accuracy, "E4M3", torch.float32)  # no FP8 rounding: exact attention
    assert relative_error(fp8_query_route(case, q_scale), exact) < 1e-5


def test_static_fp8_query_scale_saturates_like_vllms_quant():
    # A query scale far below the query's magnitude clamps Q at the e4m3 finite max, as vLLM's
    # static QuantFP8 does: a large but finite error, never NaN (an unclamped cast gives NaN).
    case = make_case(shapes.dry_run()[1], torch.device("cpu"), seed=5)
    exact = attention_oracle(case, torch.float64)
    saturated = fp8_query_route(case, q_scale=1e-3)
    assert saturated.isfinite().all()
    assert relative_error(saturated, exact) > 10 * relative_error(fp8_query_route(case, 1.0), exact)


def test_accuracy_command_writes_results_that_match_its_routes(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.accuracy",
            "--preset",
            "dry-run",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},  # it re-executes
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "accuracy-dry-run-cpu.json").read_text())
    assert payload["machine"].startswith("CPU") and payload["preset"] == "dry-run"
    backends = {e["backend"] for e in payload["accuracy"]}
    assert {"triton", "reference", "torch emulation"} <= backends
    best = accuracy.best_fp8_query_errors(payload["accuracy"])
    rows = (tmp_path / "accuracy-dry-run-cpu.md").read_text().splitlines()
    for kv_len in accuracy.ACCURACY_KV_LENS["dry-run"]:
        (row,) = [line for line in rows if line.startswith(f"| {kv_len} |")]
        assert f"{best[kv_len]:.2e}" in row


def test_cache_format_study_orders_the_formats():
    """On a drafter's K/V the unquantised cache is exact but for output rounding, every
    quantised format shows its rounding and none is broken, and FP8 with scale 1.0 (values of
    order 0.01-0.1 in e4m3's subnormals) loses to int8 with per-token-head scales."""
    entries = accuracy.run_cache_formats(accuracy.accuracy_shapes("dry-run"))
    columns = [*accuracy.CACHE_FORMATS, *accuracy.FP8_QUERY_OVER]
    for kv_len in accuracy.ACCURACY_KV_LENS["dry-run"]:
        errors = {e["format"]: e["rel_err"] for e in entries if e["kv_len"] == kv_len}
        assert list(errors) == columns
        assert errors["unquantised"] < 1e-3
        for column in columns[1:]:
            assert 5 * errors["unquantised"] < errors[column] < 0.5, (kv_len, column, errors)
        assert errors["int8_per_token_head"] < errors["fp8_scale_1"]


def test_committed_cache_format_table_is_its_json(tmp_path):
    results = REPO / "benchmarks" / "results"
    payload = json.loads((results / "accuracy-cache-formats-quick-cpu.json").read_text())
    rendered = tmp_path / "formats.md"
    accuracy.write_cache_formats_markdown(rendered, payload)
    assert rendered.read_text() == (results / "accuracy-cache-formats-quick-cpu.md").read_text()
    kv_lens = sorted({e["kv_len"] for e in payload["cache_formats"]})
    assert kv_lens == list(accuracy.ACCURACY_KV_LENS["quick"])


def test_vllm_kernel_loads_without_touching_sys_modules():
    if not all((vllm_peer.PEER_DIR / f).is_file() for f in vllm_peer.KERNEL_FILES):
        pytest.skip("vLLM's kernel is not in .peers/ (run benchmarks/fetch_peers.sh)")
    before = {name: module for name, module in sys.modules.items() if name.startswith("vllm")}
    kernel = vllm_peer.load()
    after = {name: module for name, module in sys.modules.items() if name.startswith("vllm")}
    assert before == after
    assert callable(kernel.unified_attention)


def test_spent_time_budget_skips_shapes_and_still_writes_everything(tmp_path):
    from benchmarks.suite import run_suite

    paths = run_suite(
        "dry-run",
        tmp_path,
        torch.device("cpu"),
        only={"reference", "torch_sdpa"},
        accuracy=False,
        time_budget_s=0.0,
    )
    payload = json.loads(paths[0].read_text())
    assert payload["complete"] is True and payload["rows"] == []
    assert len(payload["skipped"]) == 2 * len(shapes.dry_run())
    assert all("time budget" in skip["reason"] for skip in payload["skipped"])
    assert "time budget" in paths[1].read_text()
    assert all(path.stat().st_size > 0 for path in paths[2:])


def test_windowed_bytes_scale_with_the_window_not_the_context():
    shape = shapes.windowed_drafter()
    # Queries at 131064..131071 see keys from 131064 - 4095 = 126969 on; its 64-key page starts
    # at 126912: 4160 keys (65 pages) of K and V per sequence and KV head, one byte each.
    assert shape.block_size == 64
    assert (shape.first_key, shape.keys_read, shape.pages_read) == (126912, 4160, 65)
    q_and_out = 2 * (32 * 8) * 32 * 128 * 2
    assert shape.bytes == 2 * 32 * 4160 * 8 * 128 + q_and_out
    # Twice the context: the same bytes and FLOPs; twice the window: about twice the KV bytes.
    longer = dataclasses.replace(shape, kv_len=2 * shape.kv_len)
    assert (longer.bytes, longer.flops) == (shape.bytes, shape.flops)
    wider = dataclasses.replace(shape, window=(8191, 8191))
    assert wider.kv_bytes() / shape.kv_bytes() == pytest.approx(2, rel=0.01)
    unwindowed = dataclasses.replace(shape, window=(-1, -1))
    assert unwindowed.kv_bytes() / shape.kv_bytes() == pytest.approx(131072 / 4160)
    # FLOPs count the keys each query sees: 4096 + token for query token 0..7.
    assert shape.flops == 4 * 32 * sum(4096 + t for t in range(8)) * 32 * 128
    # Bytes come from whole pages: a window ending inside a page still reads the page.
    for left in (0, 5, 15, 16, 17, 63, 64, 65, 100):
        small = dataclasses.replace(shape, q_len=1, kv_len=1000, window=(left, left))
        start = 999 - left
        assert small.first_key == start // 64 * 64 and small.keys_read >= left + 1


def test_the_presets_hold_the_windowed_drafter():
    assert shapes.windowed_drafter() in shapes.quick()
    assert shapes.windowed_drafter(sinks=True) in shapes.full()


def _direct_attention(case, seq: int, token: int, head: int) -> torch.Tensor:
    """One output row in float64 from the definitions (SPEC §3), key by key."""
    shape = case.shape
    kv_head = head // (shape.num_q_heads // shape.num_kv_heads)
    pages = case.block_table[seq].long()

    def column(paged: torch.Tensor) -> torch.Tensor:  # [kv_len, ...] of this sequence and head
        return paged[pages].flatten(0, 1)[: shape.kv_len, kv_head].double()

    key, value = column(case.key_cache.float()), column(case.value_cache.float())
    if shape.per_token_head:
        key, value = key * column(case.k_scale)[:, None], value * column(case.v_scale)[:, None]
    else:
        key, value = key * float(case.k_scale[kv_head]), value * float(case.v_scale[kv_head])
    query = case.query[seq * shape.q_len + token, head].double()
    position = shape.kv_len - shape.q_len + token
    left, right = shape.window
    seen = [
        j
        for j in range(shape.kv_len)
        if (not shape.causal or j <= position)
        and (left < 0 or j >= position - left)
        and (right < 0 or j <= position + right)
    ]
    logits = (key[seen] @ query) * case.softmax_scale
    weights = torch.exp(logits - logits.max())
    denominator = weights.sum()
    if case.sinks is not None:
        denominator += torch.exp(case.sinks[head].double() - logits.max())
    return (weights[:, None] * value[seen]).sum(0) / denominator


def per_token_head_shapes() -> list[shapes.Shape]:
    return [shape for shape in shapes.dry_run() if shape.per_token_head]


def test_dry_run_holds_both_per_token_head_formats_and_both_masks():
    held = {(shape.kv_cache_dtype, shape.causal) for shape in per_token_head_shapes()}
    assert {kv_cache_dtype for kv_cache_dtype, _ in held} == set(PER_TOKEN_HEAD)
    assert {causal for _, causal in held} == {True, False}


# The windows (one spanning pages, one causal with sinks) and the per-token-head scales.
ORACLE_CHECKED = [s for s in shapes.dry_run() if s.window != (-1, -1)] + per_token_head_shapes()


@pytest.mark.parametrize("shape", ORACLE_CHECKED, ids=shapes.Shape.label)
def test_oracle_matches_the_definition(shape):
    assert shape.window == (-1, -1) or shape.first_key > 0
    case = make_case(shape, torch.device("cpu"), seed=7)
    oracle = attention_oracle(case, torch.float64)
    for seq in range(shape.batch):
        for token in (0, shape.q_len - 1):
            for head in (0, shape.num_q_heads - 1):
                expected = _direct_attention(case, seq, token, head)
                got = oracle[seq * shape.q_len + token, head]
                assert relative_error(got, expected) < 1e-12


@pytest.mark.parametrize("shape", per_token_head_shapes(), ids=shapes.Shape.label)
def test_per_token_head_case_is_vllms_page_with_scales_per_token(shape):
    """The caches and scales are views of one vLLM page (written by reshape_and_cache), the
    scales differ per token within a head, and a rotated copy is the same page elsewhere."""
    case = make_case(shape, torch.device("cpu"), seed=3)
    page = case.page
    assert page.shape == (case.key_cache.shape[0], shape.num_kv_heads, shape.block_size,
                          2 * (shape.head_dim + 4))  # fmt: skip
    assert page.dtype == (
        torch.int8 if shape.kv_cache_dtype == "int8_per_token_head" else torch.uint8
    )
    for view in (case.key_cache, case.value_cache, case.k_scale, case.v_scale):
        assert view.untyped_storage().data_ptr() == page.untyped_storage().data_ptr()
    assert case.key_cache.dtype == shape.cache_dtype
    assert case.k_scale.shape == (*case.key_cache.shape[:3],)
    # Each token's scale is its row's amax over the format's max: it follows the token.
    per_head = case.k_scale.flatten(0, 1)
    assert (per_head.amax(0) / per_head.amin(0) > 4).all()
    assert (per_head > 0).all() and not torch.equal(case.k_scale, case.v_scale)
    copy = case.clone_storage()
    assert torch.equal(copy.page, page) and copy.page.stride() == page.stride()
    assert copy.page.data_ptr() != page.data_ptr()
    assert copy.k_scale.data_ptr() != case.k_scale.data_ptr()
    assert torch.equal(copy.k_scale, case.k_scale)
    # What a copy takes in memory (the rotation's cap): the whole page, scales included.
    assert case.storage_bytes == case.query.nbytes + page.numel()
    assert case.storage_bytes > case.query.nbytes + 2 * case.key_cache.nbytes


def _run(adapter, case) -> torch.Tensor:
    prepared = adapter.prepare(case)
    prepared.run()
    return prepared.result()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_our_runners_pass_the_window_and_sinks(backend):
    from benchmarks.peers import Ours

    for shape in shapes.dry_run()[-2:]:
        case = make_case(shape, torch.device("cpu"), seed=11)
        got = _run(Ours(backend), case)
        assert relative_error(got, attention_oracle(case)) < 5e-3, shape.label()
        unwindowed = dataclasses.replace(case, shape=dataclasses.replace(shape, window=(-1, -1)))
        assert relative_error(got, attention_oracle(unwindowed)) > 0.1, shape.label()
        if shape.sinks:
            sinkless = dataclasses.replace(case, sinks=None)
            assert relative_error(got, attention_oracle(sinkless)) > 0.05, shape.label()


def per_token_head_runners():
    from benchmarks import peers

    runners = [peers.Ours("reference"), peers.Ours("triton"), peers.TorchSdpa()]
    if all((vllm_peer.PEER_DIR / f).is_file() for f in vllm_peer.KERNEL_FILES):
        runners.append(peers.VllmTritonUnified())
    return runners


@pytest.mark.parametrize("shape", per_token_head_shapes(), ids=shapes.Shape.label)
def test_every_runner_reads_the_same_per_token_head_page(shape):
    """Ours (through split_per_token_head_cache), vLLM's TRITON_ATTN kernel (as its forward
    views the page) and SDPA on the dequantised copy all answer the problem with the page's
    own scales: not scales of 1, not one scale per head."""
    case = make_case(shape, torch.device("cpu"), seed=11)
    exact = attention_oracle(case)
    ones = torch.ones(shape.num_kv_heads)
    per_head = [scale.flatten(0, 1).mean(0) for scale in (case.k_scale, case.v_scale)]
    for adapter in per_token_head_runners():
        k_scale, v_scale = adapter.given_scales(case)
        assert k_scale is case.k_scale and v_scale is case.v_scale, adapter.name
        got = _run(adapter, case)
        assert relative_error(got, exact) < 5e-3, adapter.name
        assert relative_error(got, attention_oracle(case, torch.float32, ones, ones)) > 0.5
        assert relative_error(got, attention_oracle(case, torch.float32, *per_head)) > 0.05


def test_peers_that_take_no_per_token_head_scales_say_why():
    from benchmarks import peers

    case = make_case(per_token_head_shapes()[0], torch.device("cpu"))
    for adapter in (peers.Fa3Fp8Query(), peers.FlashInfer()):
        with pytest.raises(peers.Unsupported, match="per-token-head"):
            adapter.prepare(case)


def test_peers_run_the_window_or_say_why_not():
    from benchmarks import peers

    shape = shapes.dry_run()[-2]  # bidirectional (40, 40) window
    case = make_case(shape, torch.device("cpu"), seed=13)
    unwindowed = dataclasses.replace(case, shape=dataclasses.replace(shape, window=(-1, -1)))
    runners = [peers.TorchSdpa(), peers.FlexAttention()]
    if all((vllm_peer.PEER_DIR / f).is_file() for f in vllm_peer.KERNEL_FILES):
        runners.append(peers.VllmTritonUnified())
    for adapter in runners:
        got = _run(adapter, case)
        expected = attention_oracle(case, torch.float32, *adapter.given_scales(case))
        assert relative_error(got, expected) < 5e-3, adapter.name
        other = attention_oracle(unwindowed, torch.float32, *adapter.given_scales(case))
        assert relative_error(got, other) > 0.1, adapter.name
    # A window a peer cannot express is refused with the reason, never run without it.
    lopsided = make_case(dataclasses.replace(shape, window=(40, 2)), torch.device("cpu"))
    with pytest.raises(peers.Unsupported, match=r"symmetric|\(w, w\)"):
        peers.VllmTritonUnified().prepare(lopsided)
    with pytest.raises(peers.Unsupported, match="left-only"):
        peers.FlashInfer().prepare(lopsided)
    sinks = make_case(shapes.dry_run()[-1], torch.device("cpu"))
    for adapter in (peers.TorchSdpa(), peers.FlexAttention(), peers.FlashInfer()):
        with pytest.raises(peers.Unsupported, match="sink"):
            adapter.prepare(sinks)
    # The drafter's right bound never binds (its queries are the last keys): FlashInfer's
    # left-only window gives every query the same keys, so it runs there.
    drafter = shapes.windowed_drafter()
    assert peers.expressible_window(drafter, "x", (4095, -1), "") == (4095, -1)


def test_dry_run_times_the_windowed_shapes_with_their_window(dry_run):
    payload, result, _ = dry_run
    windowed = [row for row in payload["rows"] if tuple(row["window"]) != (-1, -1)]
    assert {row["backend"] for row in windowed} >= {"reference", "triton", "torch_sdpa"}
    assert {row["sinks"] for row in windowed} == {True, False}
    for row in windowed:
        shape = shapes.Shape(**{**row_shape_fields(row), "window": tuple(row["window"])})
        assert row["bytes"] == shape.bytes < row["context_bytes"]
        assert row["within_tolerance"] is True
    skipped = {(s["backend"], s["sinks"]) for s in payload["skipped"] if s["sinks"]}
    assert {("torch_sdpa", True), ("flex_attention", True)} <= skipped
    assert "window40,40" in result.with_suffix(".md").read_text()


def row_shape_fields(row: dict) -> dict:
    return {field.name: row[field.name] for field in dataclasses.fields(shapes.Shape)}


def test_window_goal_sets_the_time_against_reading_the_context():
    from benchmarks import report

    shape = shapes.windowed_drafter()
    row = {
        **shape.fields(),
        "backend": "triton",
        "median_us": 100.0,
        "frac_of_copy_bw": 0.5,
        "context_bytes": dataclasses.replace(shape, window=(-1, -1)).bytes,
        "speedup": {"torch_sdpa": 3.0},
    }
    payload = {"timings_meaningful": True, "copy_bw_gbps": 4000.0, "rows": [row], "accuracy": []}
    (line,) = [line for line in report.goals(payload) if "pages the window" in line]
    assert "window4095,4095" in line and "met" in line and "NOT" not in line
    row["median_us"] = 1e6  # slower than reading all 131072 keys could be
    assert any("pages the window" in line and "NOT met" in line for line in report.goals(payload))


def test_rotated_copies_of_a_long_cache_are_capped_by_memory(monkeypatch):
    from benchmarks import suite

    shape = shapes.dry_run()[-2]  # a window over a longer context: few bytes, a whole cache
    case = make_case(shape, torch.device("cpu"))
    case_bytes = case.query.nbytes + case.key_cache.nbytes + case.value_cache.nbytes
    monkeypatch.setattr(suite, "rotation_count", lambda nbytes, device: 64)
    monkeypatch.setattr(suite, "MAX_ROTATION_BYTES", 3 * case_bytes)
    assert len(suite.ShapeRun(shape, torch.device("cpu"), seed=0).copies) == 3
    monkeypatch.setattr(suite, "MAX_ROTATION_BYTES", case_bytes // 2)
    assert len(suite.ShapeRun(shape, torch.device("cpu"), seed=0).copies) == 1


PREFILL_LENGTHS = (4096, 8192, 16384)


def test_presets_hold_the_noncausal_prefill_shapes():
    """The prefill shapes: q = kv = 4k / 8k / 16k, BF16 query over e4m3 (and the BF16 and
    per-token-head caches beside it), 32 query / 8 KV heads, head_dim 128, page 64, non-causal;
    --quick holds the 4k one."""
    expected = {
        shapes.Shape("prefill", 1, n, n, 32, 8, 128, False, kv, "bfloat16", 64)
        for n in PREFILL_LENGTHS
        for kv in ("fp8_e4m3", "bfloat16", *PER_TOKEN_HEAD)
    }
    assert {s for s in shapes.full() if s.kind == "prefill"} == expected
    (quick,) = [s for s in shapes.quick() if s.kind == "prefill"]
    assert quick == shapes.prefill(4096) and quick.kv_cache_dtype == "fp8_e4m3"
    assert quick == shapes.quick()[-1]  # the time budget cuts it first


@pytest.mark.parametrize("length", PREFILL_LENGTHS)
def test_prefill_flops_come_from_the_mask_and_bytes_read_the_cache_once(length):
    shape = shapes.prefill(length)
    # Non-causal: every one of the 32 query heads' q rows meets every key, in two GEMMs.
    assert shape.flops == 4 * length * length * 128 * 32
    kv = 2 * length * 8 * 128  # K and V of 8 KV heads, one byte each
    q_and_out = 2 * length * 32 * 128 * 2
    assert shape.kv_bytes() == kv and shape.bytes == kv + q_and_out
    # 8 FLOP per KV byte per query token: compute-bound far past any GPU's ridge point.
    assert shape.flops / shape.kv_bytes() == 8 * length
    causal = dataclasses.replace(shape, causal=True)
    assert causal.flops == 4 * (length * (length + 1) // 2) * 128 * 32
    assert causal.bytes == shape.bytes


def prefill_payload(gpu: str, peak: float | None, frac: float | None) -> dict:
    shape = shapes.prefill(8192)
    tflops = 0.0 if frac is None else frac * peak / 1e12
    row = {
        **shape.fields(),
        "backend": "mma_sync",
        "median_us": 1000.0,
        "tflops": tflops,
        "frac_of_copy_bw": 0.01,
        "frac_of_tensor_peak": frac,
        "speedup": {"torch_sdpa": 2.0},
    }
    peer = {**row, "backend": "torch_sdpa", "speedup": {}}
    peer["frac_of_tensor_peak"] = None if frac is None else frac / 2
    return {
        "gpu": gpu,
        "timings_meaningful": True,
        "copy_bw_gbps": 4000.0,
        "dense_16bit_tflops": None if peak is None else peak / 1e12,
        "rows": [row, peer],
        "accuracy": [],
    }


def test_prefill_goal_is_stated_against_the_dense_tensor_peak():
    from benchmarks import report

    payload = prefill_payload("NVIDIA H200", 989.4e12, 0.65)
    (line,) = [line for line in report.goals(payload) if "prefill" in line]
    assert "65% of the dense 16-bit tensor peak (989 TFLOP/s" in line
    assert "4 x q x kv x head_dim x heads" in line and "best peer torch_sdpa 32%" in line
    assert "goal >= 60%: met" in line and "copy bandwidth" not in line
    assert not any("drafter rows" in line for line in report.goals(payload))
    payload["rows"][0]["frac_of_tensor_peak"] = 0.4
    assert any("prefill" in line and "NOT met" in line for line in report.goals(payload))
    # The table shows a prefill row against the tensor peak, a drafter row against copy BW.
    assert report.yardstick_fractions(payload["rows"][0]) == (None, pytest.approx(40.0))
    drafter = {**payload["rows"][0], "kind": "drafter", "frac_of_copy_bw": 0.9}
    assert report.yardstick_fractions(drafter) == (pytest.approx(90.0), None)
    # A GPU whose peak is not on record: TFLOP/s only, no fraction made up.
    unknown = prefill_payload("NVIDIA H100 PCIe", None, None)
    (line,) = [line for line in report.goals(unknown) if "prefill" in line]
    assert "no dense 16-bit tensor peak on record for NVIDIA H100 PCIe" in line


def test_dense_tensor_peak_is_the_datasheet_figure_of_that_exact_gpu():
    from tools.sass_model.hardware import dense_16bit_peak

    assert dense_16bit_peak("NVIDIA H200")[0] == 989.4e12
    assert dense_16bit_peak("NVIDIA B200")[0] == 2.25e15
    assert "datasheet" in dense_16bit_peak("NVIDIA H200")[1]
    for other in ("NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3", "cpu"):
        assert dense_16bit_peak(other) is None
