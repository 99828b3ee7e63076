"""The built CUDA extension, inspected without a GPU (runs in CI).

Checks with cuobjdump (pip ``nvidia-cuda-cuobjdump`` + ``nvidia-cuda-nvdisasm``) that ``_C`` holds
machine code for every arch it was built for (sm_90a and sm_100a by default), that the attention
kernels run on tensor cores (HMMA, from mma.sync) and that no hot kernel touches local memory
(register spills or stack arrays), which would cost far more than their arithmetic. Also the
host-side split-KV plan, which needs the extension's tile sizes but no GPU.
"""

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DEFAULT_ARCHS = {"90a", "100a"}
ATTENTION_KERNEL = "paged_attention_kernel"
HOT_KERNELS = (ATTENTION_KERNEL, "merge_splits_kernel")
# (head_dim, query dtype, cache dtype) instantiations per arch.
# head dims x query dtypes x caches (e4m3, e5m2, the query's own 16-bit dtype)
NUM_ATTENTION_KERNELS = 3 * 2 * 3


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

    return [arch.removesuffix("-real") for arch in _C.CUDA_ARCHS.split(",")]


@functools.cache
def sass_functions(arch: str) -> dict[str, str]:
    """Mangled kernel name -> its SASS text, for one arch's cubin."""
    sass = cuobjdump("-sass", "-arch", f"sm_{arch}")
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@functools.cache
def resource_usage(arch: str) -> dict[str, dict[str, int]]:
    """Mangled kernel name -> {"REG": .., "STACK": .., "LOCAL": .., ...} for one arch."""
    text = cuobjdump("-res-usage", "-arch", f"sm_{arch}")
    usage = {}
    for name, fields in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", text):
        usage[name] = {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", fields)}
    return usage


def test_cubin_for_every_built_arch():
    listing = cuobjdump("-lelf")
    cubins = set(re.findall(r"\.sm_(\w+)\.cubin", listing))
    archs = set(built_archs())
    assert archs <= cubins, listing
    if not os.environ.get("FP8NCA_CUDA_ARCHS"):
        assert DEFAULT_ARCHS <= archs, f"default build must hold {DEFAULT_ARCHS}, has {archs}"


@pytest.mark.parametrize("arch", sorted(DEFAULT_ARCHS))
def test_attention_kernels_use_tensor_cores(arch):
    if arch not in built_archs():
        pytest.skip(f"sm_{arch} not in this build")
    functions = sass_functions(arch)
    attention = {n: s for n, s in functions.items() if ATTENTION_KERNEL in n}
    assert len(attention) == NUM_ATTENTION_KERNELS, sorted(functions)
    for name, sass in attention.items():
        assert re.search(r"\bHMMA\.16816\.F32", sass), f"{name} on sm_{arch} has no HMMA"
        assert "LDGSTS" in sass, f"{name} on sm_{arch} does not use cp.async"


@pytest.mark.parametrize("arch", sorted(DEFAULT_ARCHS))
def test_hot_kernels_do_not_spill(arch):
    if arch not in built_archs():
        pytest.skip(f"sm_{arch} not in this build")
    usage = resource_usage(arch)
    functions = sass_functions(arch)
    hot = sorted(n for n in usage if any(k in n for k in HOT_KERNELS))
    assert hot, sorted(usage)
    table = "\n".join(f"sm_{arch} {usage[n]['REG']:3d} regs  {n}" for n in hot)
    print(table)
    for name in hot:
        assert usage[name]["STACK"] == 0 and usage[name]["LOCAL"] == 0, (name, usage[name])
        assert not re.search(r"\b(LDL|STL)\b", functions[name]), f"{name} uses local memory"


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
def test_split_kv_fills_whole_waves(batch, kv_len, resident, expected):
    """The split count for drafter shapes (batch x 8 tokens x 32/8 heads, d128)."""
    _extension_path()
    from fp8_noncausal_attn import cuda_backend
    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    case = make_case([8] * batch, [16] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128)
    kwargs = case.kwargs() | {"max_seqlen_k": kv_len}
    problem = validate_attention(
        *case.args(), **kwargs, softmax_scale=None, out=None, validate=False
    )
    splits = cuda_backend.num_splits_for(problem, resident)
    assert splits == expected
    ctas = batch * 8 * splits
    if 1 < splits < cuda_backend.MAX_SPLITS:
        assert ctas / (-(-ctas // resident) * resident) >= cuda_backend.WAVE_FILL
