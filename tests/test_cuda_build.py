"""The built CUDA extension, inspected without a GPU (runs in CI).

Checks with cuobjdump (pip ``nvidia-cuda-cuobjdump`` + ``nvidia-cuda-nvdisasm``) that ``_C`` holds
machine code for every arch it was built for (the visible GPU's by default; with
``FP8NCA_CUDA_ARCHS=all``, as CI's release wheel, sm_89, sm_90, the sm_100 family and sm_120)
and PTX for the newest, that every kernel family's attention kernels run on tensor cores
(HMMA, from mma.sync) on every arch, and that no hot kernel touches local memory (register
spills or stack arrays), which would cost far more than their arithmetic. Also the C++ plan
(split-KV, tiles, workspace sizes) and the availability rules (arch families, PTX JIT, driver
version), which need no GPU: the host code is read from every build present (the
``host_code`` fixture: the SIMT executor's, and ``_C`` where one is in the tree), the machine
code from ``_C`` alone, skipped without it.
"""

import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch
from helpers import NUM_ATTENTION_KERNELS, NUM_TOKEN_SCALE_KERNELS, replaced
from helpers.backends import gpu_stand_in

from fp8_noncausal_attn import launch_record
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.backends.protocol import Refused

DEFAULT_ARCHS = ("89", "90", "100f", "120")
DEFAULT_PTX = "120"
# Kernel family -> (kernel name, its MMA instruction in SASS, its async copy instruction).
FAMILIES = {"mma_sync": ("paged_attention_kernel", r"\bHMMA\.16816\.F32", "LDGSTS")}
HOT_KERNELS = ("paged_attention_kernel", "merge_splits_kernel", "reshape_and_cache_kernel")


def _extension_path() -> Path:
    spec = importlib.util.find_spec("fp8_noncausal_attn._C")
    if spec is None or spec.origin is None:
        pytest.skip("fp8_noncausal_attn._C was not built (no nvcc, or FP8NCA_BUILD_CUDA=0)")
    return Path(spec.origin)


def _tool_dir() -> Path:
    """Folder holding cuobjdump and nvdisasm (the pip packages, else PATH)."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for candidate in Path(root).glob("cu*/bin"):
            if (candidate / "cuobjdump").exists() and (candidate / "nvdisasm").exists():
                return candidate
    found = shutil.which("cuobjdump")
    if found and shutil.which("nvdisasm"):
        return Path(found).parent
    pytest.skip(
        "cuobjdump/nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    )


def cuobjdump(*args: str) -> str:
    tools = _tool_dir()
    env = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}")
    result = subprocess.run(
        [str(tools / "cuobjdump"), *args, str(_extension_path())],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return result.stdout


def built_archs() -> list[str]:
    from fp8_noncausal_attn import _C

    return _C.CUDA_ARCHS.split(",")


@functools.cache
def sass_text(arch: str) -> str:
    """cuobjdump's SASS listing of one arch's cubins (each with its ``arch = sm_..`` header)."""
    return cuobjdump("-sass", "-arch", f"sm_{arch}")


@functools.cache
def sass_functions(arch: str) -> dict[str, str]:
    """Mangled kernel name -> its SASS text, for one arch's cubins."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass_text(arch), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@functools.cache
def resource_usage(arch: str) -> dict[str, dict[str, int]]:
    """Mangled kernel name -> {"REG": .., "STACK": .., "LOCAL": .., ...} for one arch."""
    text = cuobjdump("-res-usage", "-arch", f"sm_{arch}")
    usage = {}
    for name, fields in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", text):
        usage[name] = {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", fields)}
    return usage


def require_arch(arch: str) -> None:
    _extension_path()
    if arch not in built_archs():
        pytest.skip(f"sm_{arch} not in this build ({built_archs()})")


@pytest.mark.compile
def test_the_build_holds_every_arch_it_names_and_ptx_for_the_newest():
    _extension_path()  # skips where _C was not built
    from fp8_noncausal_attn import _C

    archs = built_archs()
    # Arch by arch: the later tests read the same listings (cached), not a second dump of all.
    for arch in archs:
        headers = set(re.findall(r"^arch = sm_(\w+)$", sass_text(arch), flags=re.MULTILINE))
        assert headers == {arch}, (arch, headers)
    ptx = set(re.findall(r"\.sm_(\w+)\.ptx", cuobjdump("-lptx")))
    assert ptx == {_C.PTX_ARCH}, ptx
    assert _C.PTX_ARCH == archs[-1]
    if os.environ.get("FP8NCA_CUDA_ARCHS") == "all":
        assert tuple(archs) == DEFAULT_ARCHS
        assert _C.PTX_ARCH == DEFAULT_PTX


@pytest.mark.compile
@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_kernels_use_tensor_cores(family, arch):
    require_arch(arch)
    kernel, mma, copy = FAMILIES[family]
    functions = sass_functions(arch)
    attention = {n: s for n, s in functions.items() if kernel in n}
    # The per-head and the per-token-head kernels (the LSE has no kernel of its own).
    assert len(attention) == NUM_ATTENTION_KERNELS + NUM_TOKEN_SCALE_KERNELS, sorted(functions)
    for name, sass in attention.items():
        assert re.search(mma, sass), f"{name} on sm_{arch} has no {mma}"
        assert copy in sass, f"{name} on sm_{arch} does not use {copy}"


@pytest.mark.compile
@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_hot_kernels_do_not_spill(arch):
    require_arch(arch)
    usage = resource_usage(arch)
    functions = sass_functions(arch)
    hot = sorted(n for n in usage if any(k in n for k in HOT_KERNELS))
    assert {k for k in HOT_KERNELS if any(k in n for n in hot)} == set(HOT_KERNELS), hot
    table = "\n".join(f"sm_{arch} {usage[n]['REG']:3d} regs  {n}" for n in hot)
    print(table)
    for name in hot:
        assert usage[name]["STACK"] == 0 and usage[name]["LOCAL"] == 0, (name, usage[name])
        assert not re.search(r"\b(LDL|STL)\b", functions[name]), f"{name} uses local memory"


@pytest.mark.compile
@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_mask_runs_only_on_tiles_that_need_it(arch):
    """The mask (causal or bidirectional bound and sliding window, csrc/mma_sync/mask.cuh) sets
    scores to -inf with FSEL inside the main loop, but in no block that every iteration runs:
    tiles that every row sees whole branch around it, so the unwindowed bidirectional loop pays
    one comparison per tile for the window (control flow of tools.sass_model)."""
    require_arch(arch)
    from tools.sass_model.cfg import ControlFlowGraph
    from tools.sass_model.pipes import is_tensor
    from tools.sass_model.sass import parse

    def masks(graph, blocks) -> bool:
        return any(
            ins.base == "FSEL" and "-INF" in ins.operands
            for b in blocks
            for ins in graph.block_instructions(b)
        )

    kernel = FAMILIES["mma_sync"][0]
    for name, sass in sass_functions(arch).items():
        if kernel not in name:
            continue
        graph = ControlFlowGraph(parse(sass))
        loop = graph.main_loop(is_tensor)
        assert masks(graph, loop.body), f"{name} on sm_{arch}: no mask in the main loop"
        assert not masks(graph, graph.every_iteration(loop)), f"{name} on sm_{arch} masks all"


@pytest.mark.compile
@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_token_scale_kernels_add_only_the_scales_to_their_twins_main_loop(arch):
    """Each per-token-head kernel's main loop against its per-head twin's (FP8 caches): the
    same MMAs, two more async copies (each key row's K and V scale ride with its tile) and one
    more conversion per value pair a thread dequantises (value x scale rounded to 16 bits); the
    K scales are fp32 multiplies on the scores, no conversion. The int8 kernels (no twin) turn
    bytes into numbers by byte moves: no integer-to-float conversion in their loop."""
    require_arch(arch)
    from collections import Counter

    from helpers import host_hooks

    from tools.sass_model.cfg import ControlFlowGraph
    from tools.sass_model.pipes import CONVERSION, is_tensor, pipe_of
    from tools.sass_model.sass import parse

    def loop_counts(sass):
        graph = ControlFlowGraph(parse(sass))
        body = [ins for b in graph.main_loop(is_tensor).body for ins in graph.block_instructions(b)]
        counts = Counter(ins.base for ins in body)
        counts[CONVERSION] = sum(pipe_of(ins) == CONVERSION for ins in body)
        return counts

    functions = sass_functions(arch)
    token_scaled = {n: s for n, s in functions.items() if "_pthI" in n}
    assert len(token_scaled) == NUM_TOKEN_SCALE_KERNELS
    variant = re.compile(r"_pthILi(\d+)E\w+?Li(\d)E")
    # Mangled names carry each identifier's length: the per-head twin's is 4 shorter.
    pth_name = re.compile(r"(\d+)(paged_attention_kernel\w*?)_pthI")
    for name, sass in token_scaled.items():
        head_dim, cache_dtype = (int(x) for x in variant.search(name).groups())
        counts = loop_counts(sass)
        if cache_dtype == extension.DTYPE_CODES[torch.int8]:
            assert not counts.keys() & {"I2F", "I2FP", "I2I"}, f"{name} on sm_{arch}"
            continue
        ident = pth_name.search(name).group(2)
        twin = pth_name.sub(f"{len(ident)}{ident}I", name)
        block_m = 128 if "_m128_" in name else 64
        value_pairs = host_hooks.load().mma_sync_tables(head_dim, 1, block_m)["copy_slots"] * 8
        plain = loop_counts(functions[twin])
        assert counts["HMMA"] == plain["HMMA"], f"{name} on sm_{arch}"
        assert counts["LDGSTS"] == plain["LDGSTS"] + 2, f"{name} on sm_{arch}"
        assert counts[CONVERSION] == plain[CONVERSION] + value_pairs, f"{name} on sm_{arch}"


def drafter_problem(batch: int, kv_len: int, q_len: int = 8):
    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    case = make_case([q_len] * batch, [32] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128)
    kwargs = case.kwargs() | {"max_seqlen_k": kv_len}
    return validate_attention(*case.args(), **kwargs, softmax_scale=None, out=None, validate=False)


@pytest.mark.parametrize(
    "batch,kv_len,resident,expected",
    [
        (32, 8192, 396, 3),
        (8, 8192, 396, 6),
        (32, 8192, 200, 1),
        (32, 300, 396, 1),
        (1, 8192, 396, 32),
    ],
)
def test_split_kv_fills_whole_waves(host_code, batch, kv_len, resident, expected):
    """The C++ plan's split count for drafter shapes (batch x 8 tokens x 32/8 heads, d128)."""
    splits = mma_sync.num_splits_for(drafter_problem(batch, kv_len).batch, resident)
    assert splits == expected
    ctas = batch * 8 * splits
    if 1 < splits < host_code.MAX_SPLITS:
        assert ctas / (-(-ctas // resident) * resident) >= host_code.WAVE_FILL
    assert extension.MAX_SPLITS == host_code.MAX_SPLITS


@pytest.mark.parametrize(
    "batch,window,causal,expected",
    [
        (8, (-1, -1), False, 6),
        (8, (127, 127), False, 1),  # 127 + 8 keys: 4 tiles, too few to split
        (8, (127, -1), False, 1),  # the right side ends at the context's end
        (8, (-1, 127), False, 6),  # unbounded on the left: the whole context
        (8, (127, -1), True, 1),
        (1, (-1, -1), False, 32),
        (1, (4095, 4095), False, 16),  # 4095 + 8 keys: 66 tiles, 4 per split at least
        (1, (1023, 1023), False, 4),
        (1, (1023, 0), True, 4),
    ],
)
def test_windowed_plan_sizes_splits_from_the_window(host_code, batch, window, causal, expected):
    """The C++ plan sizes split-KV from the key tiles one CTA's window spans over a 128k
    context (batch x 8 tokens x 32/8 heads, d128), not from the context."""
    batch = dataclasses.replace(drafter_problem(batch, 131072).batch, window=window, causal=causal)
    assert mma_sync.num_splits_for(batch, 396) == expected


@pytest.mark.parametrize("seed", range(4))
def test_split_planner_is_the_plans_rule_for_any_tiles(host_code, seed):
    """_C.plan_splits (the DSL families' planner) with the mma.sync plan's own tiles gives the
    plan's split count, and a longer key tile never gives more splits than a shorter one."""
    rng = torch.Generator().manual_seed(seed)
    for _ in range(50):
        pick = lambda *options: options[int(torch.randint(len(options), (1,), generator=rng))]  # noqa: E731
        sizes = dict(
            num_seqs=pick(1, 2, 7, 64), num_q_heads=pick(8, 32), num_kv_heads=8,
            max_seqlen_q=pick(1, 8, 40), max_seqlen_k=pick(100, 4096, 70000),
            window_left=pick(-1, 127, 2000), window_right=pick(-1, 0, 64), causal=pick(False, True),
        )  # fmt: skip
        resident = pick(132, 396)
        plan = host_code.plan(**sizes, num_tokens=sizes["num_seqs"] * sizes["max_seqlen_q"],
                              head_dim=128, cache_dtype=2, resident_ctas=resident)  # fmt: skip
        splits_of = functools.partial(
            host_code.plan_splits, **sizes, block_m=plan["block_m"], resident_ctas=resident
        )
        assert splits_of(block_n=plan["block_n"]) == plan["num_splits"]
        wide = splits_of(block_n=4 * plan["block_n"])
        assert 1 <= wide <= plan["num_splits"], sizes
        assert splits_of(block_n=64, num_splits=5) == 5


def test_dtype_codes_are_the_extensions(host_code):
    assert {str(k).removeprefix("torch."): v for k, v in extension.DTYPE_CODES.items()} == (
        host_code.DTYPE_CODES
    )
    assert launch_record.SCALE_MODES == host_code.SCALE_MODES


def test_cache_write_refuses_an_int8_cache_before_any_cuda_call(host_code):
    """int8 has a dtype code for the attention kernels, but the cache write has no int8 path
    (per-token-head caches are written elsewhere): the binding refuses it, never launches."""
    codes = host_code.DTYPE_CODES
    with pytest.raises(ValueError, match="writes no int8 cache"):
        host_code.reshape_and_cache(
            device=0, stream=0, key=0, value=0, key_cache=0, value_cache=0, slot_mapping=0,
            k_scale=0, v_scale=0, key_strides=(0, 0), value_strides=(0, 0),
            kc_strides=(0, 0, 0), vc_strides=(0, 0, 0), slot_stride=1, num_tokens=1,
            num_kv_heads=1, head_dim=64, block_size=16, in_dtype=codes["bfloat16"],
            cache_dtype=codes["int8"],
        )  # fmt: skip


@pytest.mark.parametrize("forced", [None, 1, 5])
def test_plan_reports_grid_and_workspace(host_code, forced):
    """Grid (M tiles, KV heads, seqs x splits [+ the padded-rows slice when unsplit]) and the
    split-KV workspace (fp32 partial O and LSE) that run() needs."""
    problem = drafter_problem(batch=3, kv_len=9000, q_len=24)
    plan = mma_sync.kernel_plan(problem.batch, resident=396, num_splits=forced)
    splits = plan["num_splits"]
    assert splits == (forced or splits) and splits >= 1
    m_tiles = -(-24 * 4 // plan["block_m"])
    assert plan["m_tiles"] == m_tiles
    assert plan["grid"] == (m_tiles, 8, 3 * splits + (1 if splits == 1 else 0))
    rows = splits * problem.num_tokens * 32 if splits > 1 else 0
    assert (plan["ws_lse_elems"], plan["ws_o_elems"]) == (rows, rows * 128)
    # 96 rows per KV head on e4m3 at d128: the 128-row tile, 8 warps
    assert (plan["block_m"], plan["block_n"], plan["threads"]) == (128, 64, 256)
    assert plan["smem_bytes"] <= 99 * 1024  # fits sm_89 / sm_120 SMs


def test_backend_passes_window_and_sinks_to_the_kernels(monkeypatch):
    """mma_sync hands the launch the sinks pointer and the window sides (a side past any
    int32 position capped, -1 kept), and the plan the window and the launch-wide causal flag."""
    import contextlib

    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    calls = {}
    cxx_plan = object()  # stands for _C.Plan: the launch must get it back as it is

    def plan(**kwargs):
        calls["plan"] = kwargs
        return {"num_splits": 1, "launch": cxx_plan, "kernel_name": "paged_attention_kernel"}

    def paged_attention(**kwargs):
        assert kwargs["plan"] is cxx_plan
        calls.setdefault("launch", kwargs["fields"])

    ext = types.SimpleNamespace(plan=plan, paged_attention=paged_attention, MAX_SEQS=1 << 20)
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    gpu_stand_in(monkeypatch, ext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(
        cuda_stream=0))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    case = make_case([3], [40], num_q_heads=4, num_kv_heads=2, causal=True)
    sinks = torch.tensor([1.0, -2.0, 3.0, 0.5])
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        window=(2**40, -1), sinks=sinks,
    )  # fmt: skip
    monkeypatch.setattr(mma_sync, "resident_ctas", lambda batch: 100)
    unsplit = mma_sync.plan(problem.batch)
    assert calls["plan"]["window_left"] == 2**31 - 1 and calls["plan"]["window_right"] == -1
    assert calls["plan"]["causal"] is True
    mma_sync.run(problem, unsplit, torch.empty_like(case.query))
    launch = calls["launch"]
    assert launch["sinks"] == sinks.data_ptr()
    assert (launch["window_left"], launch["window_right"]) == (2**31 - 1, -1)
    calls.clear()
    unwindowed = dataclasses.replace(problem.batch, window=(-1, -1))
    plain = dataclasses.replace(problem, batch=unwindowed, sinks=None)
    mma_sync.run(plain, unsplit, torch.empty_like(case.query))
    assert (calls["launch"]["sinks"], calls["launch"]["window_left"]) == (0, -1)


def test_the_launch_fills_every_field_the_extension_takes_and_nothing_else(monkeypatch, host_code):
    """mma_sync.run passes _C.paged_attention one value for each Given field of AttnParams
    (the launch record's mma.sync fields, csrc/common/launch_record.h, exported as
    _C.ATTN_FIELDS with the record's hash), read from the problem, and the plan's _C.Plan as
    it is; the binding refuses a missing or an unknown field, a block_shift that is not
    log2(block_size), and a plan made for other sizes, before any CUDA call."""
    import contextlib

    from fp8_noncausal_attn import launch_record as R
    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    calls = {}
    ext = types.SimpleNamespace(paged_attention=lambda **kwargs: calls.update(kwargs))
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    gpu_stand_in(monkeypatch, ext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(
        cuda_stream=0))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    case = make_case([3, 2], [40, 9], causal=[True, False], index_step=2, seed=3)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    report = host_code.plan(**extension.plan_sizes(problem), num_tokens=problem.num_tokens,
                            head_dim=problem.head_dim, cache_dtype=2, resident_ctas=1)  # fmt: skip
    mma_sync.run(problem, mma_sync.MmaSyncPlan(1, None, None, report["launch"]),
                 torch.empty_like(case.query))  # fmt: skip
    assert calls["plan"] is report["launch"] and calls["plan"].num_splits == 1
    fields = calls["fields"]
    assert tuple(fields) == host_code.ATTN_FIELDS == tuple(f.name for f in R.given(R.MMA_SYNC))
    assert host_code.LAUNCH_RECORD_HASH == R.record_hash(R.MMA_SYNC)
    assert fields["block_shift"] == 4 and fields["sl_stride"] == 2
    assert fields["bt_stride_b"] == problem.block_table.stride(1) == 2
    assert fields["causal_per_seq"] == problem.causal_per_seq.data_ptr()
    assert fields["causal_bytes"] == 1 and fields["causal_stride"] == 2
    assert fields["cu_stride"] == 2 and fields["num_splits"] == 1
    launch = functools.partial(
        host_code.paged_attention,
        device=0,
        stream=0,
        plan=report["launch"],
        q_dtype=0,
        cache_dtype=2,
    )
    empty = dict(fields, num_tokens=0)  # no row: the binding returns before any CUDA call
    assert launch(fields=empty) is None
    with pytest.raises(ValueError, match="takes no extra"):
        launch(fields=dict(empty, extra=1))
    with pytest.raises(ValueError, match="block_shift must be log2"):
        launch(fields=dict(empty, block_shift=5))
    for other in ({"num_seqs": 3}, {"num_kv_heads": 4}, {"num_splits": 2}):
        with pytest.raises(ValueError, match="plan was made for other sizes"):
            launch(fields=dict(fields, **other))
    del empty["sinks"]
    with pytest.raises(ValueError, match="needs sinks"):
        launch(fields=empty)


def test_backend_passes_token_scale_strides_and_refuses_what_is_not_compiled(monkeypatch):
    """A batch planned per token and head: run() passes scale_mode per_token_head and each
    scale's (block, slot, head) strides; per-head scales pass per_head and zero strides.
    Batches no kernel is compiled for are refused by plan(), with the reason (the scale kind is
    the batch's): per-token-head scales over a 16-bit cache, an int8 cache with per-head
    scales; and a layer's own tensors at run time: vLLM's inline pages, whose rows are not
    16-byte aligned."""
    import contextlib

    from helpers.token_heads import token_head_problem

    from fp8_noncausal_attn.layouts import split_per_token_head_cache
    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    calls = []
    ext = types.SimpleNamespace(paged_attention=lambda **kwargs: calls.append(kwargs["fields"]),
                                MAX_SEQS=1 << 20)  # fmt: skip
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    gpu_stand_in(monkeypatch, ext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(
        cuda_stream=0))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    plan = mma_sync.MmaSyncPlan(1, None, None, object())
    problem = token_head_problem(torch.int8, torch.bfloat16, [3], [40])
    case = make_case([3], [40], cache_dtype=torch.bfloat16)
    per_head = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    for layer in (problem, per_head):
        assert mma_sync.run_unsupported_reason(layer, None) is None
        mma_sync.run(layer, plan, torch.empty_like(layer.query))
    pth, plain = calls
    assert pth["scale_mode"] == launch_record.SCALE_MODES["per_token_head"]
    assert (pth["k_scale"], pth["v_scale"]) == (problem.k_scale.data_ptr(),
                                                problem.v_scale.data_ptr())  # fmt: skip
    for name, scale in (("ks", problem.k_scale), ("vs", problem.v_scale)):
        assert tuple(pth[f"{name}_stride_{d}"] for d in "bsh") == scale.stride()
    assert len(set(problem.k_scale.stride())) == 3 and problem.k_scale.stride()[1] != 1
    assert plain["scale_mode"] == launch_record.SCALE_MODES["per_head"]
    assert all(plain[f"{name}_stride_{d}"] == 0 for name in ("ks", "vs") for d in "bsh")

    assert mma_sync.plan_refusal(problem.batch) is None
    assert mma_sync.plan_refusal(per_head.batch) is None
    refused = {
        "compiled for e4m3, e5m2 and int8": dataclasses.replace(
            per_head.batch, scale_mode="per_token_head"
        ),
        "int8 cache is compiled with per-token-head": dataclasses.replace(
            problem.batch, scale_mode="per_head"
        ),
    }
    for why, batch in refused.items():
        assert why in mma_sync.plan_refusal(batch)
        with pytest.raises(Refused, match=why):
            mma_sync.plan(batch)
    vllm_page = torch.zeros(3, 2, 16, 2 * (64 + 4), dtype=torch.uint8)
    names = ("key_cache", "value_cache", "k_scale", "v_scale")
    vllm_caches = dict(zip(names, split_per_token_head_cache(vllm_page, torch.int8), strict=True))
    why = mma_sync.run_unsupported_reason(replaced(problem, **vllm_caches), None)
    assert "multiples of 16 bytes" in why


def test_merge_entry_passes_the_partials_and_refuses_other_layouts(monkeypatch):
    """extension.merge_splits (the DSL families' merge) hands _C.merge_splits the partials,
    `out` with its strides, the sinks and cu_seqlens_q; partials of another shape, dtype or
    layout, and an `out` whose head dims are strided, are refused before any launch."""
    import contextlib

    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    calls = []
    ext = types.SimpleNamespace(merge_splits=lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    gpu_stand_in(monkeypatch, ext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(
        cuda_stream=7))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    case = make_case([3, 2], [40, 9], num_q_heads=4, num_kv_heads=2, padded_rows=1)
    sinks = torch.tensor([1.0, -2.0, 3.0, 0.5])
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False, sinks=sinks
    )
    ws_o, ws_lse = torch.zeros(3, 6, 4, 64), torch.zeros(3, 6, 4)
    out = torch.empty(6, 5, 64, dtype=torch.bfloat16)[:, :4]
    extension.merge_splits(problem, ws_o, ws_lse, out)
    (call,) = calls
    assert call == {
        "device": None, "stream": 7, "ws_o": ws_o.data_ptr(), "ws_lse": ws_lse.data_ptr(),
        "out": out.data_ptr(), "o_strides": (320, 64), "sinks": sinks.data_ptr(),
        "cu_seqlens_q": problem.cu_seqlens_q.data_ptr(),
        "cu_stride": problem.cu_seqlens_q.stride(0), "num_seqs": 2, "num_splits": 3,
        "num_tokens": 6, "num_q_heads": 4, "head_dim": 64, "q_dtype": 0,
    }  # fmt: skip
    for bad_o, bad_lse, bad_out in (
        (ws_o[:, :5], ws_lse, out),
        (ws_o, ws_lse.double(), out),
        (ws_o.transpose(1, 2).contiguous().transpose(1, 2), ws_lse, out),
        (ws_o, ws_lse, torch.empty(6, 4, 128, dtype=torch.bfloat16)[..., ::2]),
    ):
        with pytest.raises(ValueError):
            extension.merge_splits(problem, bad_o, bad_lse, bad_out)
    assert len(calls) == 1


def fake_extension(archs: str, ptx: str, driver: int, runtime: int = 13000):
    return types.SimpleNamespace(
        CUDA_ARCHS=archs, PTX_ARCH=ptx, CUDA_RUNTIME_VERSION=runtime,
        driver_version=lambda: driver,
    )  # fmt: skip


@pytest.mark.parametrize(
    "capability,runs",
    [
        ((8, 9), True),  # L4 / L40S: sm_89 cubin
        ((9, 0), True),  # H100 / H200: sm_90 cubin
        ((10, 0), True),  # B200: sm_100f cubin
        ((10, 3), True),  # B300: same family
        ((12, 0), True),  # RTX Blackwell: sm_120 cubin
        ((12, 1), True),  # sm_121 (DGX Spark): sm_120 cubin, same major
        ((13, 0), True),  # a future GPU: PTX of compute_120, JIT
        ((8, 0), False),  # A100: no FP8 conversion instructions (sm_89+)
        ((8, 6), False),
    ],
)
def test_availability_accepts_every_gpu_the_binary_runs_on(monkeypatch, capability, runs):
    ext = fake_extension("89,90,100f,120", "120", driver=13000)
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # _C's answer (mma_sync is available without it too: CPU tensors run on the executor).
    ok, why = extension.availability()
    assert ok == runs, why
    if not runs:
        assert f"sm_{capability[0]}{capability[1]}" in why


def test_arch_specific_cubins_run_only_on_their_gpu():
    assert extension.runs_on((9, 0), ["90a"], None)
    assert not extension.runs_on((10, 3), ["100a"], None)  # the old build on a B300
    assert extension.runs_on((10, 3), ["100f"], None)
    assert not extension.runs_on((11, 0), ["100f"], None)
    assert not extension.runs_on((9, 0), ["89"], None)
    assert extension.runs_on((9, 0), ["89"], "89")


def test_old_driver_makes_the_backend_unavailable(monkeypatch):
    """The extension links the CUDA 13 runtime statically: an older driver cannot run it."""
    ext = fake_extension("89,90,100f,120", "120", driver=12040, runtime=13000)
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ok, why = extension.availability()
    assert not ok
    assert "driver 12.4 found, 13.0 needed" in why
    ext.driver_version = lambda: 13010
    assert extension.availability()[0]


def test_extension_reports_its_runtime_and_the_driver():
    _extension_path()
    from fp8_noncausal_attn import _C

    assert _C.CUDA_RUNTIME_VERSION >= 12080
    assert _C.driver_version() >= 0  # 0: no driver on this machine
