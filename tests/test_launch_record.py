"""The launch record (fp8_noncausal_attn/launch_record.py): the mma.sync header generated from it,
one name per value, its hash, and the refusal at load time of a compiled library (``_C``, a DSL
family's) built from another record."""

import dataclasses
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import fp8_noncausal_attn
import fp8_noncausal_attn.launch_record as R
from dsl import build
from fp8_noncausal_attn.backends.cuda import dsl as dsl_families
from fp8_noncausal_attn.backends.cuda import extension
from tools import launch_record as generator


def test_the_committed_header_is_the_records():
    """csrc/common/launch_record.h is what the generator writes from the record, byte for
    byte: the mma.sync fields in order, each with its type and source, and the hash."""
    assert generator.HEADER.read_text() == generator.header()
    assert generator.main(["--check"]) == 0
    text = generator.header()
    assert f'#define FP8NCA_LAUNCH_RECORD_HASH "{R.record_hash(R.MMA_SYNC)}"' in text
    rows = [line.strip() for line in text.splitlines() if line.startswith("  X(")]
    assert [row.split(",")[1].strip() for row in rows] == [f.name for f in R.fields(R.MMA_SYNC)]
    assert rows[0].startswith("X(const void*, q, Given)")
    assert rows[3].startswith("X(void*, out, Given)")
    assert "X(int, group, Derived)" in text and "X(const int32_t*, seq_lens, Given)" in text


def test_one_name_per_value():
    """Every field has one name, and a name means one value in every family that takes it."""
    names = [f.name for f in R.FIELDS]
    assert len(set(names)) == len(names)
    for family in R.FAMILIES:
        assert set(R.fields(family)) <= set(R.FIELDS)
        assert all(f.value is not None for f in R.given(family))
    assert all(f.value is not None for f in R.given(R.TRITON))
    with pytest.raises(ValueError, match="unknown kernel family"):
        R.fields("reference")


def test_the_hash_follows_the_fields_names_kinds_and_order(monkeypatch):
    """A renamed, retyped, moved or added field changes the hash of each family that takes it,
    and of no other."""
    before = {family: R.record_hash(family) for family in R.FAMILIES}
    fields = list(R.FIELDS)
    at = next(i for i, f in enumerate(fields) if f.name == "cu_stride")
    head, tail = fields[:at], fields[at + 1 :]
    changes = {
        "renamed": head + [dataclasses.replace(fields[at], name="cu_step")] + tail,
        "retyped": head + [dataclasses.replace(fields[at], kind="i32")] + tail,
        "moved": fields[:at] + [fields[at + 1], fields[at]] + fields[at + 2:],
        "added": fields + [R.Field("extra", "i32", "a new argument", lambda i: 0)],
    }  # fmt: skip
    for name, changed in changes.items():
        monkeypatch.setattr(R, "FIELDS", tuple(changed))
        after = {family: R.record_hash(family) for family in R.FAMILIES}
        assert all(after[f] != before[f] for f in R.FAMILIES), name
    dsl_only = fields + [R.Field("extra", "i32", "", lambda i: 0, families=R.DSL_FAMILIES)]
    monkeypatch.setattr(R, "FIELDS", tuple(dsl_only))
    assert R.record_hash(R.MMA_SYNC) == before[R.MMA_SYNC]
    assert R.record_hash("wgmma") != before["wgmma"]


def test_the_hash_follows_the_scale_modes(monkeypatch):
    """What a library was built from includes the scale_mode values its kernels switch on:
    changing them changes the mma.sync hash."""
    before = R.record_hash(R.MMA_SYNC)
    monkeypatch.setattr(R, "SCALE_MODES", {"per_head": 1, "per_token_head": 0})
    assert R.record_hash(R.MMA_SYNC) != before
    monkeypatch.undo()
    assert R.record_hash(R.MMA_SYNC) == before


# ---- a library from another record is refused when it is loaded ------------------------------


@pytest.fixture
def fake_extension(monkeypatch):
    """``_C`` replaced by a module that exports only a record hash (set it per test)."""
    fake = types.ModuleType("fp8_noncausal_attn._C")
    fake.__file__ = "/fake/_C.so"
    monkeypatch.setitem(sys.modules, "fp8_noncausal_attn._C", fake)
    monkeypatch.setattr(fp8_noncausal_attn, "_C", fake, raising=False)
    extension.load.cache_clear()
    yield fake
    extension.load.cache_clear()


def test_an_extension_from_another_record_is_refused_when_loaded(fake_extension):
    """``extension.load`` refuses a ``_C`` whose hash is not the record's, naming both: the
    mma_sync backend runs no CUDA tensors, says why, and ``auto`` moves on (it may still run CPU
    tensors through the SIMT executor, which builds its own module)."""
    fake_extension.LAUNCH_RECORD_HASH = "0123456789ab"
    ext, why = extension.load()
    assert ext is None
    assert "/fake/_C.so" in why and "0123456789ab" in why and R.record_hash(R.MMA_SYNC) in why
    assert extension.availability() == (False, why)
    report = fp8_noncausal_attn.available_backends()
    assert why in report["mma_sync"]["reason"]
    assert report["auto"]["choice"] != "mma_sync"
    del fake_extension.LAUNCH_RECORD_HASH  # built before _C exported one
    extension.load.cache_clear()
    ext, why = extension.load()
    assert ext is None and "hash none" in why
    fake_extension.LAUNCH_RECORD_HASH = R.record_hash(R.MMA_SYNC)
    extension.load.cache_clear()
    assert extension.load() == (fake_extension, "")


STUB_HEADER = """\
#include <stdint.h>
typedef struct {{ int unused; }} {sym}_Kernel_Module_t;
static void {sym}_Kernel_Module_Load({sym}_Kernel_Module_t *m) {{ (void)m; }}
static int cute_dsl_{sym}_wrapper({sym}_Kernel_Module_t *m, ...) {{ (void)m; return 0; }}
"""


def build_stub_library(folder: Path, family: str, edit=lambda source: source) -> Path:
    """``libfp8nca_<family>.so`` from the entry source dsl/build.py writes (``edit``ed), around
    a stub kernel module: the C interface of a real library, built in a second."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    runtime = build.CUDA_HOME / "include" / "cuda_runtime.h"
    if cc is None or not runtime.is_file():
        pytest.skip("needs a C compiler and the CUDA headers")
    variant = build.WGMMA_VARIANTS[0] if family == "wgmma" else build.VARIANTS[0]
    arch = "sm_90a" if family == "wgmma" else "sm_100f"
    sym = build.symbol(variant, arch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{sym}.h").write_text(STUB_HEADER.format(sym=sym))
    entries = [(sym, f"{variant.name}@{arch}", build.forward(variant))]
    (folder / "entry.c").write_text(edit(build.entry_source(entries, family)))
    library = folder / build.library_name(family)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(library), str(folder / "entry.c"), "-I", str(folder),
         "-I", str(runtime.parent), "-lpthread"],
        check=True,
    )  # fmt: skip
    return library


@pytest.mark.parametrize("family", R.DSL_FAMILIES)
def test_a_dsl_library_from_another_record_is_refused_when_loaded(tmp_path, monkeypatch, family):
    """``load_library`` refuses a library whose exported hash is not the record's (naming the
    library and both hashes) or that exports none; the family's availability says so. The
    library built from this record loads."""
    own = R.record_hash(family)
    monkeypatch.setattr(dsl_families, "package_library_dir", lambda name: tmp_path / "package")
    cases = {
        "other": lambda source: source.replace(f'return "{own}";', 'return "0123456789ab";'),
        "none": lambda source: "\n".join(
            line for line in source.splitlines() if "_launch_record(void)" not in line
        ),
        "own": lambda source: source,
    }
    for name, edit in cases.items():
        library = build_stub_library(tmp_path / name, family, edit)
        monkeypatch.setenv(dsl_families.LIBRARY_DIR_ENV, str(library.parent))
        dsl_families.load_library.cache_clear()
        try:
            loaded, why = dsl_families.load_library(family)
            availability = dsl_families.FAMILIES[family].availability()
        finally:
            dsl_families.load_library.cache_clear()
        if name == "own":
            assert loaded is not None and loaded.record_hash == own, why
            assert loaded.argument_names == tuple(f.name for f in R.given(family))
            continue
        assert loaded is None and str(library) in why and own in why
        assert ("0123456789ab" if name == "other" else "hash none") in why
        assert availability == (False, why)
