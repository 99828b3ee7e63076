"""Stand-in for every GPU job of the GPU check in its dry run: ``gpu_step.py MODULE ARGS...``.

Sleeps a moment and writes what the real job writes (the JSON lines, pytest -v lines and
result files that the driver reads). Two planted errors, for tests/test_gpu_check.py:
``GPU_CHECK_STUB_HANG=MODULE`` makes that module's jobs hang (SIGTERM ignored, so only
``timeout -k``'s KILL ends them); ``GPU_CHECK_STUB_FAULT=BACKEND`` makes that backend fault:
its smoke launch aborts, the sanitizer reports an error, a test of it fails, the benchmark
records it as failed.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

module, args = sys.argv[1], sys.argv[2:]
fault = os.environ.get("GPU_CHECK_STUB_FAULT", "")
if os.environ.get("GPU_CHECK_STUB_HANG") == module:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)
time.sleep(0.05)


def option(name):
    return args[args.index(name) + 1]


if module == "tools.gpu_check.environment":
    print(
        json.dumps(
            {
                "python": "3.12.3",
                "torch": "stub",
                "triton": "stub",
                "c_extension": "loads",
                "wgmma_library": True,
                "tcgen05_library": False,
            }
        )
    )
elif module == "tools.gpu_check.smoke":
    if args[0] == fault:
        os.abort()
    print(json.dumps({"backend": args[0], "rel_err": 3e-3, "ok": True}))
elif module == "tools.gpu_check.sanitize":
    for backend in args:
        print(f"{backend} attention: 3.00e-03 ok")
    if fault in args:
        print("========= Invalid __global__ write of size 2 bytes")
        sys.exit(3)
elif module == "pytest":
    family = os.environ.get("FP8NCA_CUDA_FAMILY", "mma_sync")
    print(f"[gw0] [ 50%] PASSED tests/test_plan.py::test_stub[{family}]")
    if fault:
        print(f"[gw1] [100%] FAILED tests/test_plan.py::test_stub[{fault}]")
        sys.exit(1)
elif module in ("benchmarks.attention", "benchmarks.accuracy"):
    out = Path(option("--out"))
    out.mkdir(parents=True, exist_ok=True)
    backends = option("--backends").split(",") if "--backends" in args else []
    # The grid's cache formats (benchmarks.shapes.grid; the test compares the two).
    kv_cache_dtypes = ("fp8_e4m3", "fp8_per_token_head", "int8_per_token_head")
    row = {
        "batch": 32,
        "q_len": 8,
        "kv_len": 16384,
        "median_us": 100.0,
        "rel_err": 3e-3,
        "frac_of_copy_bw": 0.5,
    }
    payload = {
        "copy_bw_gbps": 4300.0,
        "complete": True,
        "rows": [
            {**row, "backend": b, "kv_cache_dtype": kv}
            for kv in kv_cache_dtypes
            for b in backends
            if b != fault
        ],
        "skipped": [
            {"backend": fault, "kv_cache_dtype": kv, "reason": "failed: stub fault"}
            for kv in kv_cache_dtypes
            if fault
        ],
        "backends": {b: {"status": "ok"} for b in backends},
    }
    (out / "stub.json").write_text(json.dumps(payload))
    (out / "stub.md").write_text("# stub\n")
elif module == "tools.gpu_check.build":
    print("build stub")
else:
    sys.exit(f"gpu_step stub: no stand-in for {module}")
