"""The host-overhead benchmark runs end to end (``--quick``) and writes its figures.

Not a timing assertion: the figures are only checked to exist and be positive.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_host_overhead_quick_writes_positive_figures(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_overhead", "--quick", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "host-overhead.json").read_text())
    assert set(figures) == {"torch_add_us", "run_us", "paged_attention_us"}
    assert all(isinstance(v, float) and v > 0 for v in figures.values()), figures
    for name in figures:
        assert name in done.stdout
