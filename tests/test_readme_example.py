"""What the README tells a user to run: the quick example, the demo and the benchmark's flags.

The quick example is taken from README.md as written and executed, and its output is checked
against an independent float64 attention over the cache it wrote, so an example that runs but
computes something else fails too.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

import pytest
import torch

import fp8_noncausal_attn as fna

README = Path(__file__).resolve().parent.parent / "README.md"
QUICK_EXAMPLE_HEADING = "## Quick example"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def quick_example() -> str:
    text = README.read_text()
    assert QUICK_EXAMPLE_HEADING in text, f"README.md has no '{QUICK_EXAMPLE_HEADING}' section"
    section = text.split(QUICK_EXAMPLE_HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = python_blocks(section)
    assert blocks, "the quick example section has no python block"
    return blocks[0]


def dense_attention(ns: dict) -> torch.Tensor:
    """Bidirectional attention in float64 from the example's cache bytes and scales."""
    query, out = ns["query"], ns["out"]
    block_table, seq_lens, cu = ns["block_table"], ns["seq_lens"], ns["cu_seqlens_q"]
    num_kv_heads = ns["key_cache"].shape[2]
    group = query.shape[1] // num_kv_heads
    k_scale = ns["k_scale"].double().view(1, -1, 1)
    v_scale = ns["v_scale"].double().view(1, -1, 1)
    expected = torch.zeros_like(out, dtype=torch.float64)
    for s in range(len(seq_lens)):
        kv_len, start, end = int(seq_lens[s]), int(cu[s]), int(cu[s + 1])
        pages = block_table[s].long()
        keys = ns["key_cache"].double()[pages].flatten(0, 1)[:kv_len] * k_scale
        values = ns["value_cache"].double()[pages].flatten(0, 1)[:kv_len] * v_scale
        keys = keys.repeat_interleave(group, dim=1)  # [kv_len, num_q_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        q = query[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * q.shape[-1] ** -0.5
        expected[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return expected


def test_readme_quick_example_runs_and_computes_bidirectional_attention(capsys):
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(quick_example(), "README.md (quick example)", "exec"), namespace)
    printed = capsys.readouterr().out
    out = namespace["out"]
    assert f"{tuple(out.shape)} {out.dtype}" in printed
    assert namespace["query"].dtype == out.dtype == torch.bfloat16
    assert namespace["key_cache"].dtype == torch.float8_e4m3fn
    expected = dense_attention(namespace)
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error <= 1e-2, error
    assert fna.available_backends()["auto"]["choice"] in printed


def test_every_python_block_in_the_docs_parses():
    api = README.parent / "docs" / "api.md"
    blocks = python_blocks(README.read_text()) + python_blocks(api.read_text())
    assert len(blocks) >= 3  # the quick example, and the API and plan/run forms in docs/api.md
    for block in blocks:
        ast.parse(block)


def captured_parser(parse_args, argv, monkeypatch) -> argparse.ArgumentParser:
    parsers = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        return original(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    parse_args(argv)
    return parsers[-1]


def test_every_benchmark_flag_has_help(monkeypatch):
    from benchmarks import attention

    parser = captured_parser(attention.parse_args, ["--dry-run", "--out", "x"], monkeypatch)
    flags = [action for action in parser._actions if action.option_strings]
    assert {"--quick", "--full", "--dry-run", "--out"} <= {
        flag for action in flags for flag in action.option_strings
    }
    for action in flags:
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings


def test_demo_takes_no_flags_but_has_help(monkeypatch, capsys):
    from fp8_noncausal_attn import __main__ as demo

    parser = captured_parser(demo.parse_args, [], monkeypatch)
    assert [a.option_strings for a in parser._actions] == [["-h", "--help"]]
    assert "every backend available here" in parser.description
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--quick"])
    assert exit_info.value.code == 2


def test_demo_says_when_only_the_reference_ran(monkeypatch, capsys):
    """Without another backend, no 'agree' claim and no Triton times: what ran, and no more."""
    from fp8_noncausal_attn import __main__ as demo

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # no re-exec on a CPU machine
    monkeypatch.setattr(
        fna,
        "available_backends",
        lambda: {
            "mma_sync": {"available": False, "reason": "the CUDA extension is not built"},
            "triton": {"available": False, "reason": "triton is not installed"},
            "reference": {"available": True, "reason": "plain PyTorch"},
            "wgmma": {"available": False, "reason": "libfp8nca_wgmma.so is not built"},
            "tcgen05": {"available": False, "reason": "libfp8nca_tcgen05.so is not built"},
            "auto": {"choice": "reference", "reason": "the only one"},
        },
    )
    assert demo.main([]) == 0
    printed = capsys.readouterr().out
    assert "only the reference ran: no other backend is available here" in printed
    assert "agree" not in printed and "FAILED" not in printed
    if not torch.cuda.is_available():
        assert "times are CPU times of the PyTorch reference, not GPU timings" in printed
        assert "interpreter" not in printed.split("rel err vs reference")[1]


def test_readme_accuracy_table_is_the_committed_result(tmp_path):
    """The README's accuracy rows are those of the committed results, which are what the
    results' own JSON renders to (so a re-run that changes a figure must change both)."""
    from benchmarks import accuracy

    results = README.parent / "benchmarks" / "results"
    payload = json.loads((results / "accuracy-quick-cpu.json").read_text())
    committed = (results / "accuracy-quick-cpu.md").read_text()
    rendered = tmp_path / "accuracy.md"
    accuracy.write_markdown(rendered, payload)
    assert rendered.read_text() == committed
    table = [line for line in committed.splitlines() if line.startswith("|")]
    readme = README.read_text()
    assert len(table) == 2 + len(accuracy.ACCURACY_KV_LENS["quick"])
    for line in table:
        assert line in readme.splitlines(), line


def test_readme_cache_format_table_is_the_committed_result():
    """The README quotes the cache-format study's table as committed (whose rendering from its
    JSON is checked in tests/test_benchmarks.py)."""
    from benchmarks import accuracy

    results = README.parent / "benchmarks" / "results"
    committed = (results / "accuracy-cache-formats-quick-cpu.md").read_text()
    table = [line for line in committed.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(accuracy.ACCURACY_KV_LENS["quick"])
    readme = README.read_text().splitlines()
    for line in table:
        assert line in readme, line
