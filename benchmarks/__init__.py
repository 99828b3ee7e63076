"""Microbenchmarks of fp8_noncausal_attn against its peers (run ``python -m benchmarks.attention``).

Modules, one concern each:
  shapes:    the benchmark shapes and the sweep presets (dry-run, quick, full).
  inputs:    random paged problems (FP8 cache with per-KV-head scales, or a BF16/FP16 cache).
  oracle:    the float32/float64 attention oracle used for every ``rel_err``.
  peers:     one adapter per backend (ours and the peers), each skipped with a reason.
  vllm_peer: loads vLLM 0.34's Triton unified attention from ``.peers/`` with stubbed imports.
  timing:    CUDA-graph replay timing over rotated inputs, and the copy-bandwidth ceiling.
  accuracy:  BF16-query (ours) vs FP8-query (FA3/FA4-style) error against float64.
  report:    JSON, Markdown and PNG writers.
  attention: the command line that ties them together.
"""
