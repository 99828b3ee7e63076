"""The package has no import cycle (tools/import_cycles.py reads the source, imports nothing)."""

from pathlib import Path

from tools.import_cycles import cycles

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_has_no_import_cycle():
    assert cycles(ROOT / "fp8_noncausal_attn") == []


def write(package: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_a_cycle_is_found_through_deferred_and_relative_imports(tmp_path):
    package = write(tmp_path / "pkg", {
        "__init__.py": "from .a import f\n",
        "a.py": "from .sub import b\n\ndef f():\n    return b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def g():\n    from ..a import f  # deferred: still a cycle\n    return f\n",
        "c.py": "from . import _C\n",  # a compiled module the package does not bind: no edge
    })  # fmt: skip
    assert cycles(package) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_type_checking_imports_and_acyclic_packages_pass(tmp_path):
    package = write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\n",
        "b.py": "from .a import TYPE_CHECKING\nx = 1\n",
    })  # fmt: skip
    assert cycles(package) == []
