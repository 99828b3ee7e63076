"""The launch record (fp8_noncausal_attn/launch_record.py): the mma.sync header generated from it,
one name per value, and its hash."""

import dataclasses

import pytest

import fp8_noncausal_attn.launch_record as R
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
    with pytest.raises(ValueError, match="unknown kernel family"):
        R.fields("triton")


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
