"""The FP8_NONCAUSAL vLLM 0.33 backend, against the real vLLM package (SPEC §8).

Runs on CPU: registration and the plugin entry point, vLLM's own config parsing and
``validate_configuration``, then the builder on a real ``CommonAttentionMetadata`` and the impl's
cache write + forward for a mixed causal/bidirectional batch with per-head scales, checked
against a float64 computation and against ``fp8_noncausal_attn.reference``.
"""

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import TOLERANCE

pytest.importorskip(
    "vllm", reason="vLLM 0.33 is not installed (pip install -r requirements-vllm.txt)"
)

from vllm.config import AttentionConfig, CacheConfig, DeviceConfig, VllmConfig  # noqa: E402
from vllm.config.speculative import SpeculativeConfig  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import fp8_noncausal_attn as fna  # noqa: E402
from fp8_noncausal_attn import config, vllm_backend  # noqa: E402
from fp8_noncausal_attn.synthetic import relative_error  # noqa: E402
from fp8_noncausal_attn.vllm_backend import (  # noqa: E402
    Fp8NoncausalAttentionBackend,
    Fp8NoncausalAttentionImpl,
    Fp8NoncausalMetadataBuilder,
)

ENTRY_POINT = "fp8_noncausal_attn.vllm_backend:register"
HOPPER, BLACKWELL = DeviceCapability(9, 0), DeviceCapability(10, 0)
FP8_VIEW = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# A DFlash-like drafter layer: GQA 4, head_size 64, FP8 cache with per-KV-head scales.
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16
# Mixed batch: two bidirectional draft blocks, one causal decode, one causal chunk.
Q_LENS, KV_LENS = [8, 1, 8, 5], [40, 17, 8, 70]
CAUSAL = [False, True, False, True]
# K/V magnitudes differ 20x between the two KV heads: a dropped or broadcast scale saturates
# or loses one head entirely.
HEAD_MAGNITUDE = torch.tensor([3.0, 60.0])


def drafter_config(**overrides):
    selector = {
        "head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "fp8", "block_size": 16,
        "use_mla": False, "has_sink": False, "use_sparse": False, "use_mm_prefix": False,
        "use_per_head_quant_scales": True, "device_capability": HOPPER,
        "attn_type": "decoder", "use_non_causal": True,
    }  # fmt: skip
    return selector | overrides


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def test_register_adds_the_enum_member_once():
    vllm_backend.register()
    vllm_backend.register()
    member = AttentionBackendEnum["FP8_NONCAUSAL"]
    assert member.get_path() == "fp8_noncausal_attn.vllm_backend.Fp8NoncausalAttentionBackend"
    assert member.get_class() is Fp8NoncausalAttentionBackend
    assert Fp8NoncausalAttentionBackend.get_name() == "FP8_NONCAUSAL"


def test_entry_point_loads_through_vllm_general_plugins():
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    if ENTRY_POINT not in [point.value for point in points]:
        pytest.skip(f"entry point {ENTRY_POINT} not installed (pip install -e .)")
    # A fresh process: this one may already have registered the backend directly.
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
        "print(E['FP8_NONCAUSAL'].get_class().__qualname__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "Fp8NoncausalAttentionBackend"


def test_vllm_configs_parse_the_backend_name():
    vllm_backend.register()
    assert AttentionConfig(backend="FP8_NONCAUSAL").backend.get_class() is (
        Fp8NoncausalAttentionBackend
    )
    # The drafter-only field of --speculative-config takes the same names, any case.
    parsed = SpeculativeConfig._parse_attention_backend("fp8_noncausal")
    assert parsed is AttentionBackendEnum["FP8_NONCAUSAL"]


def test_version_guard_accepts_0_33_only():
    for good in ("0.33.0", "0.33.4", "0.33.1.dev12+gabcdef"):
        vllm_backend.check_vllm_version(good)
    for bad in ("0.32.9", "0.34.0", "1.0.0", "not-a-version"):
        with pytest.raises(RuntimeError, match=r"needs vLLM 0\.33\.x, found vLLM"):
            vllm_backend.check_vllm_version(bad)


@pytest.mark.parametrize("capability", [HOPPER, BLACKWELL, DeviceCapability(12, 0)])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "auto"])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64, None])
def test_drafter_configurations_are_accepted(capability, kv_cache_dtype, head_size, block_size):
    selector = drafter_config(
        device_capability=capability, kv_cache_dtype=kv_cache_dtype, head_size=head_size,
        block_size=block_size,
    )  # fmt: skip
    assert Fp8NoncausalAttentionBackend.validate_configuration(**selector) == []


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"use_mla": True}, "MLA not supported"),
        ({"has_sink": True}, "attention sinks not supported"),
        ({"use_sparse": True}, "sparse not supported"),
        ({"has_sliding_window": True}, "sliding window not supported"),
        ({"use_mm_prefix": True}, "partial multimodal token full attention not supported"),
        ({"device_capability": DeviceCapability(8, 0)}, "compute capability not supported"),
        ({"head_size": 96}, "head_size not supported"),
        ({"dtype": torch.float32}, "dtype not supported"),
        ({"kv_cache_dtype": "fp8_per_token_head"}, "kv_cache_dtype not supported"),
        ({"kv_cache_dtype": "nvfp4"}, "kv_cache_dtype not supported"),
        ({"block_size": 12}, "block_size not supported"),
        ({"attn_type": "encoder_only"}, "attention type encoder_only not supported"),
        ({"use_batch_invariant": True}, "batch invariance not supported"),
        ({"use_dcp": True}, "DCP not supported"),
    ],
)
def test_what_the_kernels_cannot_run_is_refused_with_vllms_reasons(overrides, reason):
    assert reason in Fp8NoncausalAttentionBackend.validate_configuration(
        **drafter_config(**overrides)
    )


@pytest.mark.parametrize("capability", [HOPPER, BLACKWELL])
def test_stock_backends_refuse_the_drafter_config_that_ours_accepts(capability):
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    plan = config.resolve_drafter_kv_cache(
        "fp8", None, drafter_non_causal=True, device_capability=tuple(capability)
    )
    assert plan.backend == "FP8_NONCAUSAL"
    selector = drafter_config(device_capability=capability, kv_cache_dtype=plan.kv_cache_dtype)
    assert Fp8NoncausalAttentionBackend.validate_configuration(**selector) == []
    assert "per-head quant scales not supported" in (
        TritonAttentionBackend.validate_configuration(**selector)
    )
    flex = FlexAttentionBackend.validate_configuration(**selector)
    assert "kv_cache_dtype not supported" in flex
    assert "per-head quant scales not supported" in flex


@dataclasses.dataclass
class _DraftOverrideTarget:
    """The two sub-configs of a VllmConfig that apply_draft_overrides touches here."""

    cache_config: CacheConfig
    attention_config: AttentionConfig


@pytest.mark.parametrize("target", ["fp8", "fp8_e5m2", "auto", "bfloat16"])
@pytest.mark.parametrize("drafter", [None, "auto", "bfloat16", "fp8", "fp8_e4m3"])
def test_dtype_split_matches_vllms_own_draft_override(target, drafter):
    vllm_backend.register()
    speculative = SimpleNamespace(moe_backend=None, attention_backend=None, kv_cache_dtype=drafter)
    configs = _DraftOverrideTarget(CacheConfig(cache_dtype=target), AttentionConfig())
    drafted = SpeculativeConfig.apply_draft_overrides(speculative, configs)
    plan = config.resolve_drafter_kv_cache(
        target, drafter, drafter_non_causal=True, device_capability=(9, 0)
    )
    assert plan.kv_cache_dtype == drafted.cache_config.cache_dtype
    speculative.attention_backend = AttentionConfig(backend=plan.backend).backend
    drafted = SpeculativeConfig.apply_draft_overrides(speculative, configs)
    assert drafted.attention_config.backend.get_class() is Fp8NoncausalAttentionBackend


CLI_CASES = [
    ["--kv-cache-dtype", "fp8", "--speculative-config.kv-cache-dtype", "bfloat16"],
    ["--kv_cache_dtype", "fp8", "--speculative_config", '{"kv-cache-dtype": "auto"}'],
    ["--kv-cache-dtype", "fp8_e5m2", "--speculative-config.method", "dflash"],
]


def test_cli_normalisation_matches_vllms_argument_parser():
    # vLLM's parser builds its default configs, which needs a platform: CPU, in a subprocess
    # so that this process keeps the one it resolved.
    code = (
        "import json, sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "parser = EngineArgs.add_cli_args(FlexibleArgumentParser())\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    ns = parser.parse_args(argv)\n"
        # EngineArgs.create_speculative_config normalises the keys exactly so.
        "    spec = {k.replace('-', '_'): v for k, v in (ns.speculative_config or {}).items()}\n"
        "    out.append([ns.kv_cache_dtype, spec.get('kv_cache_dtype')])\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, json.dumps(CLI_CASES)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    parsed_by_vllm = json.loads(result.stdout.strip().splitlines()[-1])
    for argv, (target, drafter) in zip(CLI_CASES, parsed_by_vllm, strict=True):
        flat = config.normalize_cli_options(dict(zip(argv[::2], argv[1::2], strict=True)))
        assert flat["kv_cache_dtype"] == target
        assert flat.get("speculative_config.kv_cache_dtype") == drafter


def test_builder_references_the_common_metadata_and_declares_uniform_batch_graphs(vllm_config):
    spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.uint8)  # fmt: skip
    builder = Fp8NoncausalMetadataBuilder(spec, ["drafter.layers.0.attn"], vllm_config, "cpu")
    assert builder.get_cudagraph_support(vllm_config, spec) == AttentionCGSupport.UNIFORM_BATCH
    common, _ = make_batch_metadata(torch.Generator().manual_seed(0), num_blocks=32)
    meta = builder.build(0, common)
    assert meta.query_start_loc is common.query_start_loc
    assert meta.seq_lens is common.seq_lens
    assert meta.block_table is common.block_table_tensor
    assert meta.slot_mapping is common.slot_mapping
    assert meta.causal is common.causal
    assert (meta.max_query_len, meta.max_seq_len) == (common.max_query_len, common.max_seq_len)
    assert meta.num_actual_tokens == sum(Q_LENS)
    assert builder.build(0, common.replace(causal=False)).causal is False


def make_batch_metadata(gen, num_blocks, max_seq_len=None):
    """vLLM's CommonAttentionMetadata for the mixed batch, pages shuffled; and the
    per-sequence slot of every context position."""
    q_lens, kv_lens = torch.tensor(Q_LENS), torch.tensor(KV_LENS)
    pages = [(kv + BLOCK_SIZE - 1) // BLOCK_SIZE for kv in KV_LENS]
    width = max(pages) + 2
    order = torch.randperm(num_blocks, generator=gen)[: sum(pages)].tolist()
    block_table = torch.zeros(len(KV_LENS), width, dtype=torch.int32)
    slots = []
    for seq, (kv, n) in enumerate(zip(KV_LENS, pages, strict=True)):
        block_table[seq, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        pos = torch.arange(kv)
        slots.append(block_table[seq, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    new_slots = torch.cat([s[kv - q :] for s, q, kv in zip(slots, Q_LENS, KV_LENS, strict=True)])
    query_start_loc = torch.zeros(len(Q_LENS) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=kv_lens.to(torch.int32),
        num_reqs=len(Q_LENS),
        num_actual_tokens=sum(Q_LENS),
        max_query_len=max(Q_LENS),
        max_seq_len=max(KV_LENS) if max_seq_len is None else max_seq_len,
        block_table_tensor=block_table,
        slot_mapping=new_slots,
        causal=torch.tensor(CAUSAL),
    )
    return common, slots


def drafter_rows(gen, n):
    """[n, NUM_KV_HEADS, HEAD_SIZE] bf16 K or V rows, HEAD_MAGNITUDE apart per KV head."""
    noise = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen) + 0.1
    return (noise * HEAD_MAGNITUDE[None, :, None]).to(torch.bfloat16)


def dequantized(rows, scale, cache_view_dtype):
    """What the cache holds, as float64: rows / scale rounded to the cache format, times scale."""
    if cache_view_dtype is None:
        return rows.double()
    per_head = scale.double()[None, :, None]
    return (rows.float() / scale[None, :, None]).to(cache_view_dtype).double() * per_head


def float64_attention(query, keys, values, softmax_scale):
    """SPEC §3 in float64, one sequence at a time: keys/values are per-sequence [kv, Hkv, D]."""
    out, start = [], 0
    group = NUM_HEADS // NUM_KV_HEADS
    for q_len, kv_len, causal, k, v in zip(Q_LENS, KV_LENS, CAUSAL, keys, values, strict=True):
        q = query[start : start + q_len].double()
        start += q_len
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", q, k) * softmax_scale
        if causal:
            visible = (
                torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
            )
            scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize(
    "kernel, kv_cache_dtype",
    [
        ("reference", "fp8"),
        ("reference", "fp8_e5m2"),
        ("reference", "bfloat16"),
        pytest.param("triton", "fp8", marks=pytest.mark.skipif(
            not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
            reason="needs a GPU or TRITON_INTERPRET=1")),
    ],
)  # fmt: skip
def test_impl_writes_the_cache_and_attends_like_the_reference(
    monkeypatch, vllm_config, kernel, kv_cache_dtype
):
    monkeypatch.setenv(vllm_backend.KERNEL_ENV, kernel)
    gen = torch.Generator().manual_seed(7)
    num_blocks = 24
    softmax_scale = HEAD_SIZE**-0.5
    impl = Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, softmax_scale, NUM_KV_HEADS, None,
                                     None, kv_cache_dtype)  # fmt: skip
    view_dtype = FP8_VIEW.get(kv_cache_dtype)
    storage = torch.uint8 if view_dtype is not None else torch.bfloat16
    kv_cache = torch.zeros(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=storage)
    # max_seq_len well above every kv_len, as in a CUDA graph captured at max_model_len.
    common, slots = make_batch_metadata(gen, num_blocks, max_seq_len=4 * max(KV_LENS))
    spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=storage)  # fmt: skip
    builder = Fp8NoncausalMetadataBuilder(spec, ["drafter.layers.0.attn"], vllm_config, "cpu")
    meta = builder.build(0, common)

    keys = [drafter_rows(gen, kv) for kv in KV_LENS]
    values = [drafter_rows(gen, kv) for kv in KV_LENS]
    k_scale, v_scale = fna.compute_kv_scales(
        torch.cat(keys), torch.cat(values), fp8_dtype=view_dtype or torch.float8_e4m3fn
    )
    assert k_scale.shape == (NUM_KV_HEADS,) and k_scale[1] > 10 * k_scale[0]
    layer = SimpleNamespace(_k_scale=k_scale, _v_scale=v_scale)

    # Context first (an earlier step), then this step's tokens: padded rows past the slot
    # mapping, and two padding slots (-1), as vLLM passes them.
    context = [
        (k[: kv - q], v[: kv - q], s[: kv - q])
        for k, v, s, q, kv in zip(keys, values, slots, Q_LENS, KV_LENS, strict=True)
    ]
    impl.do_kv_cache_update(layer, torch.cat([c[0] for c in context]),
                            torch.cat([c[1] for c in context]), kv_cache,
                            torch.cat([c[2] for c in context]))  # fmt: skip
    new_k = torch.cat([k[kv - q :] for k, q, kv in zip(keys, Q_LENS, KV_LENS, strict=True)])
    new_v = torch.cat([v[kv - q :] for v, q, kv in zip(values, Q_LENS, KV_LENS, strict=True)])
    pad = drafter_rows(gen, 3)
    slot_mapping = torch.cat([common.slot_mapping, torch.full((2,), -1)])
    impl.do_kv_cache_update(layer, torch.cat([new_k, pad]), torch.cat([new_v, pad]), kv_cache,
                            slot_mapping)  # fmt: skip

    key_view, value_view = fna.split_kv_cache(kv_cache, "vllm", view_dtype)
    scales = (k_scale, v_scale) if view_dtype is not None else (torch.ones(2), torch.ones(2))
    real_k = [dequantized(k, scales[0], view_dtype) for k in keys]
    real_v = [dequantized(v, scales[1], view_dtype) for v in values]
    for seq, slot in enumerate(slots):
        blocks, offsets = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        stored_k = key_view[blocks, offsets].double() * scales[0].double()[None, :, None]
        stored_v = value_view[blocks, offsets].double() * scales[1].double()[None, :, None]
        # Each KV head is stored with its own scale (one rounding step of the format at most).
        assert relative_error(stored_k, real_k[seq]) < 1e-6
        assert relative_error(stored_v, real_v[seq]) < 1e-6

    num_tokens = sum(Q_LENS)
    query = (torch.randn(num_tokens + 3, NUM_HEADS, HEAD_SIZE, generator=gen)).to(torch.bfloat16)
    output = torch.full_like(query, 7.0)
    returned = impl.forward(layer, query, new_k, new_v, kv_cache, meta, output)
    assert returned is output
    assert torch.all(output[num_tokens:] == 7.0), "padded rows must be left alone"

    expected = float64_attention(query[:num_tokens], real_k, real_v, softmax_scale)
    assert relative_error(output[:num_tokens], expected) <= TOLERANCE[torch.bfloat16]
    oracle = fna.paged_attention(
        query[:num_tokens], key_view, value_view, common.block_table_tensor,
        common.query_start_loc, common.seq_lens, causal=common.causal,
        k_scale=scales[0], v_scale=scales[1], backend="reference",
    )  # fmt: skip
    if kernel == "reference":
        assert torch.equal(output[:num_tokens], oracle)
    else:
        assert relative_error(output[:num_tokens], oracle) <= TOLERANCE[torch.bfloat16]


def test_vllms_attention_layer_runs_the_backend_end_to_end(vllm_config):
    """vLLM's own Attention layer builds the impl (its positional call), and its forward runs
    unified_kv_cache_update + unified_attention_with_output into our impl, with per-head scale
    buffers as vLLM's compressed-tensors loader registers them."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention

    vllm_backend.register()
    gen = torch.Generator().manual_seed(11)
    name = "drafter.layers.0.self_attn.attn"
    with set_current_vllm_config(vllm_config):
        layer = Attention(
            NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads=NUM_KV_HEADS,
            cache_config=CacheConfig(cache_dtype="fp8"), prefix=name,
            attn_backend=AttentionBackendEnum["FP8_NONCAUSAL"].get_class(),
        )  # fmt: skip
    assert isinstance(layer.impl, Fp8NoncausalAttentionImpl)
    assert layer.get_kv_cache_spec(vllm_config).dtype == torch.uint8
    keys = [drafter_rows(gen, kv) for kv in KV_LENS]
    values = [drafter_rows(gen, kv) for kv in KV_LENS]
    k_scale, v_scale = fna.compute_kv_scales(torch.cat(keys), torch.cat(values))
    layer.register_buffer("_k_scale", k_scale)
    layer.register_buffer("_v_scale", v_scale)
    layer.kv_cache = torch.zeros(24, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.uint8)
    common, slots = make_batch_metadata(gen, 24)
    context = [
        (k[: kv - q], v[: kv - q], slot[: kv - q])
        for k, v, slot, q, kv in zip(keys, values, slots, Q_LENS, KV_LENS, strict=True)
    ]
    context_k, context_v, context_slots = (torch.cat(part) for part in zip(*context, strict=True))
    layer.impl.do_kv_cache_update(layer, context_k, context_v, layer.kv_cache, context_slots)
    spec = layer.get_kv_cache_spec(vllm_config)
    meta = Fp8NoncausalMetadataBuilder(spec, [name], vllm_config, "cpu").build(0, common)
    new_k = torch.cat([k[kv - q :] for k, q, kv in zip(keys, Q_LENS, KV_LENS, strict=True)])
    new_v = torch.cat([v[kv - q :] for v, q, kv in zip(values, Q_LENS, KV_LENS, strict=True)])
    num_tokens = sum(Q_LENS)
    query = torch.randn(num_tokens, NUM_HEADS * HEAD_SIZE, generator=gen).to(torch.bfloat16)
    with set_forward_context({name: meta}, vllm_config, slot_mapping={name: common.slot_mapping}):
        output = layer(query, new_k.flatten(1), new_v.flatten(1))
    assert output.shape == (num_tokens, NUM_HEADS * HEAD_SIZE)
    real_k = [dequantized(k, k_scale, torch.float8_e4m3fn) for k in keys]
    real_v = [dequantized(v, v_scale, torch.float8_e4m3fn) for v in values]
    expected = float64_attention(query.view(num_tokens, NUM_HEADS, HEAD_SIZE), real_k, real_v,
                                 HEAD_SIZE**-0.5)  # fmt: skip
    assert relative_error(output.view_as(expected), expected) <= TOLERANCE[torch.bfloat16]


def test_per_head_scales_of_the_wrong_length_fail_clearly():
    # Under TP=2 a rank of an 4-KV-head model has 2 KV heads; 4 scales means a missing slice.
    impl = Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, None, None, "fp8")
    layer = SimpleNamespace(_k_scale=torch.rand(4) + 0.5, _v_scale=torch.tensor(1.0))
    kv_cache = torch.zeros(4, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.uint8)
    key = torch.randn(2, NUM_KV_HEADS, HEAD_SIZE).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"_k_scale has shape \[4\].*2 KV heads.*tensor-parallel"):
        impl.do_kv_cache_update(layer, key, key, kv_cache, torch.tensor([0, 1]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sinks": torch.ones(NUM_HEADS)}, NotImplementedError, "sinks"),
        ({"sliding_window": 128}, NotImplementedError, "sliding_window"),
        ({"alibi_slopes": [1.0] * NUM_HEADS}, NotImplementedError, "alibi_slopes"),
        ({"logits_soft_cap": 30.0}, NotImplementedError, "logits_soft_cap"),
        ({"attn_type": "encoder_only"}, NotImplementedError, "decoder attention only"),
        ({"kv_cache_dtype": "int8_per_token_head"}, ValueError, "kv_cache_dtype"),
        ({"head_size": 96}, ValueError, "head sizes"),
    ],
)
def test_impl_refuses_what_the_kernels_cannot_do(kwargs, error, match):
    call = {"num_heads": NUM_HEADS, "head_size": HEAD_SIZE, "scale": 0.125,
            "num_kv_heads": NUM_KV_HEADS, "kv_cache_dtype": "fp8"} | kwargs  # fmt: skip
    with pytest.raises(error, match=match):
        Fp8NoncausalAttentionImpl(**call)


def test_unknown_kernel_name_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(vllm_backend.KERNEL_ENV, "flashinfer")
    with pytest.raises(ValueError, match=vllm_backend.KERNEL_ENV):
        Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, None, None, "fp8")


def test_profiling_run_without_metadata_zero_fills():
    impl = Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, None, None, "fp8")
    output = torch.ones(3, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    impl.forward(None, output, None, None, None, None, output)
    assert not output.any()


def test_forward_reads_no_device_value_on_the_host(vllm_config):
    """CUDA-graph safety without a GPU: forward on "meta" tensors, which have no values, runs
    the impl, the API's validation and the dispatch and reaches the op's fake kernel; any
    .item()/.tolist()/bool(tensor)/.cpu() on the way (a device-to-host sync on a GPU) raises."""
    impl = Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, None, None, "fp8")
    common, _ = make_batch_metadata(torch.Generator().manual_seed(3), num_blocks=32)
    common = common.replace(**{
        name: getattr(common, name).to("meta")
        for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "causal")
    })  # fmt: skip
    spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.uint8)  # fmt: skip
    meta = Fp8NoncausalMetadataBuilder(spec, ["l"], vllm_config, "meta").build(0, common)
    kv_cache = torch.empty(32, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.uint8,
                           device="meta")  # fmt: skip
    scale = torch.empty(NUM_KV_HEADS, device="meta")
    layer = SimpleNamespace(_k_scale=scale, _v_scale=scale)
    query = torch.empty(sum(Q_LENS) + 2, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="meta")
    output = torch.empty_like(query)
    assert impl.forward(layer, query, None, None, kv_cache, meta, output) is output
