"""One launch of one backend against the reference, in its own process (a fault or a hang
ends this process only): ``python -m tools.gpu_check.smoke BACKEND``.

Prints one JSON line (backend, rel_err, ok) and exits 1 when the result is off.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from .launches import TOLERANCE, attention, case, error_against_reference


def main(argv: list[str]) -> int:
    (name,) = argv
    problem_case = case()
    out = attention(name, problem_case)
    torch.cuda.synchronize()  # a fault in the kernel shows here
    error = error_against_reference(name, problem_case, out)
    ok = math.isfinite(error) and error <= TOLERANCE
    print(json.dumps({"backend": name, "rel_err": error, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
