"""docs/backends.md states each backend's status once: its table of what each backend's
``plan()`` takes is compared with ``available_backends()``, asked on a GPU stood in for where
the backend needs one (helpers.gpu_mock), so the document cannot drift from the code."""

from pathlib import Path

import pytest
from helpers.gpu_mock import DEFAULT_TABLES, FakeLibrary, mock_gpu

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import registry

DOC = Path(__file__).resolve().parent.parent / "docs" / "backends.md"
HEADING = "**What each backend's `plan()` takes**"
# The table's columns after the name, as available_backends() reports them.
COLUMNS = ("per_head", "per_token_head", "unsplit_lse", "auto")
# The GPU each CUDA family runs on (compute capability), stood in for.
CAPABILITY = {"mma_sync": (9, 0), "wgmma": (9, 0), "tcgen05": (10, 0)}


def doc_table(text: str) -> dict[str, tuple[bool, ...]]:
    """``{backend: (yes or no per column)}`` of the table after :data:`HEADING`."""
    section = text[text.index(HEADING) :]
    rows = {}
    for line in section.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and cells[0] != "`backend=`":
            assert all(cell in ("yes", "no") for cell in cells[1:]), line
            rows[cells[0].strip("`")] = tuple(cell == "yes" for cell in cells[1:])
    return rows


def report_where_it_runs(monkeypatch, name: str) -> dict[str, object]:
    """``available_backends()[name]`` on a machine where backend ``name`` runs."""
    if name in CAPABILITY:
        libraries = {name: FakeLibrary(DEFAULT_TABLES[name])} if name in DEFAULT_TABLES else {}
        mock_gpu(monkeypatch, CAPABILITY[name], libraries=libraries)
    report = fna.available_backends()[name]
    assert report["available"], (name, report["reason"])
    return report


def test_the_table_names_every_backend_once():
    assert list(doc_table(DOC.read_text())) == list(registry.BACKEND_NAMES)


@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_the_table_row_is_what_plan_accepts(monkeypatch, name):
    report = report_where_it_runs(monkeypatch, name)
    found = tuple(report[c] is True or report[c] == "yes" for c in COLUMNS)
    assert found == doc_table(DOC.read_text())[name], {c: report[c] for c in COLUMNS}
