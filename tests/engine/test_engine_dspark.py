"""DSpark's draft block on FP8_NONCAUSAL over an FP8 e4m3 paged cache, built as vLLM's V2 loader
builds it (dspark_check.py), against bidirectional attention over the cache's contents."""

from __future__ import annotations

import torch

from fp8_noncausal_attn.layouts import split_kv_cache
from fp8_noncausal_attn.synthetic import relative_error

from .checks import attention, bf16_tolerance
from .models import write_dspark_drafter, write_target


def test_dspark_draft_block_attends_bidirectionally_over_the_fp8_cache(tmp_path, fork_server):
    write_target(tmp_path / "target")
    write_dspark_drafter(tmp_path / "dspark")
    log = tmp_path / "log.txt"
    code = fork_server.run("dspark", "dspark_check", [str(tmp_path), str(tmp_path / "out.pt")],
                           log, {"VLLM_USE_V2_MODEL_RUNNER": "1"})  # fmt: skip
    assert code == 0, log.read_text()[-6000:]
    r = torch.load(tmp_path / "out.pt", weights_only=False)
    assert r["plan_causal"] is False and r["kernels"] == "reference" and r["hidden_finite"]
    key_cache, value_cache = split_kv_cache(r["kv_cache"], "vllm", torch.float8_e4m3fn)
    positions = torch.arange(r["seq_len"])
    page, offset = (
        r["pages"][positions // key_cache.shape[1]].long(),
        positions % key_cache.shape[1],
    )
    keys = key_cache[page, offset].double() * r["k_scale"].double()
    values = value_cache[page, offset].double() * r["v_scale"].double()
    first = r["seq_len"] - r["block"]
    expected = attention(r["query"], keys, values, r["scale"], None)
    causal = attention(r["query"], keys, values, r["scale"], first)
    error, causal_error = relative_error(r["output"], expected), relative_error(r["output"], causal)
    tolerance = bf16_tolerance()
    print(f"DSpark block: rel. error {error:.4f} vs bidirectional (tolerance {tolerance}), "
          f"{causal_error:.4f} vs causal")  # fmt: skip
    assert error <= tolerance
    assert causal_error > 10 * tolerance  # the mask matters: the comparison can tell
