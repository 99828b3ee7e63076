"""The build tests' cache of DSL builds: one build per hash of its inputs, never a partial one."""

import json
from types import SimpleNamespace

import pytest
from helpers import dsl as dsl_helpers


class FakeBuild:
    """Stands in for dsl.build: counts builds, writes a record, fails when asked to."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def build(self, out, archs, variants, family):
        self.calls += 1
        out.mkdir(parents=True)
        (out / "kernel.cubin").write_bytes(b"cubin")
        if self.fail:
            raise RuntimeError("ptxas failed")
        record = {"family": family, "variants": [v.name for v in variants], "archs": archs}
        (out / "build.json").write_text(json.dumps(record))
        return record


@pytest.fixture
def sources(tmp_path, monkeypatch):
    tree = tmp_path / "dsl"
    (tree / "common").mkdir(parents=True)
    (tree / "common" / "launch.py").write_text("FIELDS = ()\n")
    monkeypatch.setattr(dsl_helpers, "DSL_SOURCES", tree)
    monkeypatch.setenv(dsl_helpers.TEST_CACHE_ENV, str(tmp_path / "cache"))
    return tree


VARIANTS = [SimpleNamespace(name="d128_n32_bf16_e4m3")]


def test_a_second_build_of_the_same_inputs_is_reused(sources, tmp_path):
    fake = FakeBuild()
    first = dsl_helpers.cached_dsl_build(fake, "wgmma", ["sm_90a"], VARIANTS, tmp_path / "s1")
    second = dsl_helpers.cached_dsl_build(fake, "wgmma", ["sm_90a"], VARIANTS, tmp_path / "s2")
    assert fake.calls == 1 and first == second
    assert first[1] == {"family": "wgmma", "variants": [VARIANTS[0].name], "archs": ["sm_90a"]}


@pytest.mark.parametrize("change", ["source", "new_file", "variant", "arch", "family"])
def test_any_changed_input_builds_again(sources, tmp_path, change):
    fake = FakeBuild()
    args = ["wgmma", ["sm_90a"], VARIANTS]
    dsl_helpers.cached_dsl_build(fake, *args, tmp_path / "s1")
    if change == "source":
        (sources / "common" / "launch.py").write_text("FIELDS = ('q_ptr',)\n")
    elif change == "new_file":
        (sources / "common" / "work.py").write_text("")
    elif change == "variant":
        args[2] = [SimpleNamespace(name="d64_n32_bf16_e4m3")]
    elif change == "arch":
        args[1] = ["sm_100f"]
    else:
        args[0] = "tcgen05"
    dsl_helpers.cached_dsl_build(fake, *args, tmp_path / "s2")
    assert fake.calls == 2


def test_a_failed_build_is_not_reused(sources, tmp_path):
    fake = FakeBuild()
    fake.fail = True
    with pytest.raises(RuntimeError, match="ptxas"):
        dsl_helpers.cached_dsl_build(fake, "wgmma", ["sm_90a"], VARIANTS, tmp_path / "s1")
    fake.fail = False
    assert not list((tmp_path / "cache" / "dsl").iterdir())  # the partial build is gone
    dsl_helpers.cached_dsl_build(fake, "wgmma", ["sm_90a"], VARIANTS, tmp_path / "s2")
    assert fake.calls == 2


def test_the_cache_can_be_turned_off(sources, tmp_path, monkeypatch):
    monkeypatch.setenv(dsl_helpers.TEST_CACHE_ENV, "off")
    fake = FakeBuild()
    for scratch in ("s1", "s2"):
        out, _ = dsl_helpers.cached_dsl_build(
            fake, "wgmma", ["sm_90a"], VARIANTS, tmp_path / scratch
        )
        assert out == tmp_path / scratch
    assert fake.calls == 2
