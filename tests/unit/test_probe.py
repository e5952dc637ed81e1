"""`verlj replay --probe module:function`'s probe, as it is loaded and named (engine/post_mortem/probe.py): a probe
that cannot be one is refused in one sentence naming it; its version is its own, its module's, or a digest of its
module's source. Replaying steps through a probe: tests/integration/test_rerun.py.

    python -m pytest -n 0 tests/unit/test_probe.py
"""

from __future__ import annotations

import sys

import pytest

from verlj.engine.errors import PluginError
from verlj.engine.post_mortem.probe import load_probe, probe_name, probe_version


@pytest.fixture
def probes(tmp_path, monkeypatch):
    (tmp_path / "unit_probes.py").write_text(
        "def stats(step, batch, model):\n    return {'n': len(batch)}\n"
        "stats.version = '2'\n"
        "def plain(step, batch, model):\n    return {}\n"
        "def two(step, batch):\n    return {}\n"
        "NOT_A_FUNCTION = 3\n"
    )
    (tmp_path / "unit_probes_versioned.py").write_text("__version__ = '1.4'\ndef stats(step, batch, model):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("unit_probes", "unit_probes_versioned"):
        sys.modules.pop(name, None)


def test_a_probe_is_loaded_and_named_and_versioned(probes):
    fn = load_probe("unit_probes:stats")
    assert fn(1, [{}, {}], None) == {"n": 2} and probe_name("unit_probes:stats") == "unit_probes.stats"
    assert probe_version(fn) == "2"  # its own
    assert probe_version(load_probe("unit_probes_versioned:stats")) == "1.4"  # its module's
    digest = probe_version(load_probe("unit_probes:plain"))  # its module's source
    assert digest.startswith("src-") and len(digest) == len("src-") + 12 and digest == probe_version(load_probe("unit_probes:plain"))


@pytest.mark.parametrize("spec, said", [
    ("unit_probes", "--probe: 'unit_probes' must name a module and an attribute in it"),
    ("no_such_probe_module:f", "--probe: cannot import 'no_such_probe_module:f' (No module named 'no_such_probe_module')"),
    ("unit_probes:missing", "--probe: cannot import 'unit_probes:missing' (module 'unit_probes' has no 'missing')"),
    ("unit_probes:NOT_A_FUNCTION", "--probe: 'unit_probes:NOT_A_FUNCTION' is not a function"),
    ("unit_probes:two", "--probe: unit_probes:two (called as fn(step, batch, model)) has the wrong signature (step, batch)"),
])
def test_what_cannot_be_a_probe_is_refused_in_one_sentence(probes, spec, said):
    with pytest.raises(PluginError) as refused:
        load_probe(spec)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value), str(refused.value)
