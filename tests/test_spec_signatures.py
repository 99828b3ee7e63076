"""docs/spec.md's Python API (§4) against the package: every function it writes down exists, and
each parameter it names is there in the same place, of the same kind, with the same default.
The package may add keyword-only parameters the spec does not list (``validate``, ``window``)."""

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import fp8_noncausal_attn as fna

SPEC = Path(__file__).resolve().parent.parent / "docs" / "spec.md"


def spec_signatures() -> dict[str, ast.arguments]:
    """name -> the arguments §4's code block gives it (the first code block of §4)."""
    text = SPEC.read_text()
    section = text[text.index("## 4.") : text.index("## 5.")]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    signatures = {}
    for found in re.finditer(r"^([a-z_]+)\((.*?)\)(?: ->[^\n#]*)?", block, re.S | re.M):
        name, arguments = found[1], re.sub(r"#[^\n]*", "", found[2])
        stub = ast.parse(f"def {name}({arguments}): pass").body[0]
        signatures[name] = stub.args
    return signatures


SIGNATURES = spec_signatures()


def test_the_spec_writes_down_the_public_functions():
    assert set(SIGNATURES) >= {
        "paged_attention", "reshape_and_cache", "compute_kv_scales", "available_backends",
        "merge_attention_states",
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_spec_signature_matches_the_function(name):
    spec = SIGNATURES[name]
    actual = inspect.signature(getattr(fna, name)).parameters
    positional = [a.arg for a in spec.args]
    real_positional = [p.name for p in actual.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert real_positional == positional, name
    for argument, default in zip(spec.kwonlyargs, spec.kw_defaults, strict=True):
        parameter = actual.get(argument.arg)
        assert parameter is not None, f"{name} has no parameter {argument.arg}"
        assert parameter.kind is parameter.KEYWORD_ONLY, (name, argument.arg)
        if default is not None:
            written = eval(ast.unparse(default), {"torch": torch})  # noqa: S307 (the spec's text)
            assert parameter.default == written, (name, argument.arg)
