import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Fixed thread count and deterministic kernels for every test process (and children, via env).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")

# The suite's two tiers. `python -m pytest` runs every test (CI); `python -m pytest -m "not slow"`, the everyday
# tier, leaves out the modules marked slow: those whose tests take longest, by SECONDS below, measured, never
# guessed. SECONDS holds each test module's seconds in a full run of the suite (its tests' setup, call and teardown
# summed: the time the module holds an xdist worker), as `python -m pytest --measure-seconds FILE` writes them
# (FILE: JSON, the modules and each test function's calls). A module over SLOW_SECONDS is marked slow. Every test
# module is listed (tests/unit/test_suite_layout.py checks it, and that every module listed exists): a new one is
# measured alone at first (`python -m pytest -n 0 tests/integration/test_x.py --measure-seconds /tmp/s.json`),
# then in the next full run. These: a full run at 53c27a0 on 2 idle cores (976 tests, 15:55 of pytest).
SLOW_SECONDS = 30
SECONDS = {
    "test_forked_as_fresh.py": 213,  # measured alone (its two pytest sessions: 80 s forked, 133 s fresh), not yet in a full run
    "test_fleet.py": 340,  # 198, a TRL class on a fleet (about 30 s), tools on a fleet (about 40 s), OpenEnv on a fleet (about 58 s), its completion order through a kill (about 14 s)
    "test_verifiers_taskset.py": 277,  # measured alone with the verifiers extra installed (CI installs it); and on a Ray fleet (156 s, measured beside a CI run)
    "test_episodes.py": 159,  # 142, a group whose every reset faults (about 11 s), the eval's env states (about 6 s)
    "test_lora.py": 107,
    "test_examples.py": 100,
    "test_openenv.py": 170,  # measured alone (125 s, under load), its completion-order run (about 25 s), on vLLM (about 20 s)
    "test_forkserver.py": 95,
    "test_agents_bpe.py": 93,
    "test_trl_envs.py": 86,  # measured alone (sync 42 s with the fork servers' start, step order 23 s, completion order 21 s), not yet in a full run
    "test_vllm.py": 89,
    "test_agents.py": 87,
    "test_recovery.py": 81,
    "test_node_loss.py": 66,
    "test_hardening.py": 63,
    "test_guides.py": 58,
    "test_reshard.py": 55,
    "test_distributed.py": 54,
    "test_async.py": 47,
    "test_shipping.py": 47,
    "test_partial_rollouts.py": 38,
    "test_ray_launcher.py": 32,
    "test_rerun.py": 32,
    "test_bf16.py": 31,
    "test_hardware.py": 28,
    "test_retention.py": 54,  # 28, the archive keeping an agent's calls and an env's states (about 26 s)
    "test_interpreters.py": 27,
    "test_restarts.py": 49,  # measured alone: and a standby built for another config than the run's (about 14 s)
    "test_standby.py": 6,  # measured alone
    "test_mirror.py": 61,  # measured alone (the two-rank ZeRO-3 runs and their reference, about 25 s)
    "test_train_cli.py": 26,
    "test_async_completion.py": 22,
    "test_algorithm_runs.py": 20,
    "test_faults_quick.py": 19,
    "test_determinism.py": 17,
    "test_agents_sdk.py": 27,  # and the SDK reaching rollout.tools through its own MCP client (about 12 s)
    "test_verify_inspect.py": 13,
    "test_whatif.py": 13,
    "test_install.py": 12,
    "test_view_browser.py": 30,  # and a run with rollout.tools killed and resumed (an unresolved episode to show)
    "test_distill_runs.py": 11,
    "test_claim.py": 10,
    "test_gateway.py": 10,
    "test_gateway_tools.py": 18,  # measured alone: MCP sessions of the mcp package's client, a counting service started
    "test_tools.py": 42,  # measured alone: two kill campaigns (sync, completion) and an unresolved run
    "test_projections.py": 10,
    "test_fused_adamw.py": 9,
    "test_compaction.py": 8,
    "test_distill.py": 8,
    "test_tasks.py": 7,
    "test_verifiers_agent.py": 7,
    "test_langchain_mcp.py": 97,  # measured alone, as tools/extras.py runs it (its agent's interpreter named)  # measured alone with the verifiers extra installed (CI installs it)
    "test_overlong.py": 6,
    "test_rollout_shape.py": 9,
    "test_one_rank_group.py": 6,  # measured alone
    "test_openenv_envs.py": 1,  # measured alone
    "test_resume_config.py": 6,
    "test_doc_commands.py": 6,
    "test_journal_processes.py": 4,
    "test_gateway_responses.py": 3,
    "test_schema_compat.py": 3,
    "test_segments.py": 3,
    "test_diff_stages.py": 2,
    "test_envs.py": 2,
    "test_env_states.py": 1,  # measured alone
    "test_trl_env_adapter.py": 3,  # measured alone
    "test_partial.py": 2,
    "test_splice.py": 2,
    "test_suite_layout.py": 2,
    "test_supervise.py": 2,
    "test_code_shape.py": 1,
    "test_codec.py": 1,
    "test_compact_records.py": 1,
    "test_reaper.py": 1,
    "test_reward_faults.py": 1,
    "test_view_http.py": 1,
    "test_algorithms.py": 0,
    "test_config.py": 0,
    "test_data_and_buffer.py": 0,
    "test_docs.py": 0,
    "test_export_calls.py": 0,
    "test_fault_location.py": 0,
    "test_faults.py": 0,
    "test_faults_tool.py": 0,
    "test_fingerprint.py": 0,
    "test_fleet_resources.py": 0,
    "test_fleet_sticky.py": 0,
    "test_gateway_sdk.py": 0,
    "test_generator_pipe.py": 0,
    "test_hardware_identity.py": 0,
    "test_journal.py": 0,
    "test_loop_state.py": 0,
    "test_lora_adapters.py": 0,
    "test_manifest.py": 0,
    "test_plot.py": 0,
    "test_probe.py": 0,
    "test_ray_launch.py": 0,
    "test_reader.py": 0,
    "test_reference_model.py": 0,
    "test_registry.py": 0,
    "test_safe_load.py": 0,
    "test_schema.py": 0,
    "test_sources.py": 0,
    "test_step_line.py": 0,
    "test_topology.py": 0,
    "test_vllm_engine.py": 0,
}


def slow(nodeid: str) -> bool:
    """Whether the test `nodeid` (tests/DIR/test_x.py::test_name[params]) is in the slow tier: its module's
    seconds over SLOW_SECONDS."""
    return SECONDS.get(_module(nodeid), 0) > SLOW_SECONDS


def _module(nodeid: str) -> str:
    return nodeid.partition("::")[0].rpartition("/")[2]


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    # xdist (--dist loadscope: one test module per worker at a time) hands out the modules with the most tests
    # first, so the unit modules mix with the long multi-process ones; this order, longest first, only breaks
    # its ties. Handing out the longest first instead (--no-loadscope-reorder) made a clean-clone CI slower (33
    # min, against 27 for the CI before it): two multi-process modules at once on two cores slowed each other.
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))  # stable: the rest keep their order
    apart = [item for item in items if item.nodeid in APART_HERE]  # single tests of an extra missing here (_apart)
    if apart:
        config.hook.pytest_deselected(items=apart)
        items[:] = [item for item in items if item.nodeid not in APART_HERE]


class _SampleRunsOnce:
    """Where test_forked_as_fresh.py runs, the tests of its sample (harness.FRESH_SAMPLE) run in its two pytest sessions,
    not also in this one: its forked pass is their run in the suite's own harness, and it fails unless each passed."""

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
    def pytest_collection_modifyitems(self, config, items):
        from harness import FRESH_SAMPLE

        if not any(item.path.name == "test_forked_as_fresh.py" for item in items):
            return
        sample = set(FRESH_SAMPLE.values())
        there = [item for item in items if item.nodeid in sample]
        if there:
            config.hook.pytest_deselected(items=there)
            items[:] = [item for item in items if item.nodeid not in sample]


def _apart() -> list[str]:
    """The tests of an extra that cannot install beside dev (harness.APART: files and test ids under tests/), where its
    package is not importable here (or, for an agent's own interpreter, none is named): tools/extras.py runs them with
    a venv of their own (.ci/run calls it)."""
    import importlib.util

    from harness import AGENT_SIDE, APART

    def here(extra: str) -> bool:  # an agent's own interpreter (harness.AGENT_SIDE) is named; any other extra is importable
        return bool(os.environ.get("VERLJ_TESTS_AGENT_PYTHON")) if extra in AGENT_SIDE else importlib.util.find_spec(extra) is not None

    return [f"tests/{t}" for extra, tests in APART.items() if not here(extra) for t in tests]


APART_HERE = _apart()
collect_ignore = [t.removeprefix("tests/") for t in APART_HERE if "::" not in t]  # whole modules: never imported here


def pytest_configure(config):
    """The controller (not each xdist worker) compiles verlj's and the tests' sources to bytecode once, as pip does for an
    installed package: the editable install reads them from the checkout, and where PYTHONDONTWRITEBYTECODE is set (it
    is in this project's containers) every process the suite starts (about 800: runs, torchrun's ranks, async
    generators, Ray's actors) compiled every module it imported again (about 0.25 s of a core each). Python reads the cached files
    whatever that variable says, and checks them against each source's mtime and size as on any import. (And the
    sample test_forked_as_fresh runs is not run twice: _SampleRunsOnce.)"""
    config.pluginmanager.register(_SampleRunsOnce(), "verlj-sample-runs-once")
    if hasattr(config, "workerinput"):
        return
    import compileall

    for folder in ("engine", "journal", "cli", "tests", "examples"):
        compileall.compile_dir(REPO / folder, quiet=1, workers=1)


def pytest_addoption(parser):
    parser.addoption("--measure-seconds", metavar="FILE", default=None,
                     help="write each test module's seconds (its tests' setup, call and teardown summed), and each "
                          "test function's calls, to FILE as JSON: what SECONDS in tests/conftest.py holds")


_MEASURED: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module = _module(report.nodeid)
    _MEASURED[module] = _MEASURED.get(module, 0.0) + report.duration
    if report.when == "call":
        test = f"{module}::{report.nodeid.partition('::')[2].partition('[')[0]}"
        _MEASURED[test] = _MEASURED.get(test, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--measure-seconds")
    if path and not hasattr(session.config, "workerinput"):  # the controller, which gets every worker's reports
        import json

        seconds = {k: round(v, 1) for k, v in sorted(_MEASURED.items(), key=lambda kv: -kv[1])}
        Path(path).write_text(json.dumps(seconds, indent=1) + "\n")


@pytest.fixture(scope="session")
def bpe_model(tmp_path_factory) -> str:
    """A Qwen2-shaped model with a real tokenizer, made locally (examples/make_bpe_model.py: a byte-level BPE
    trained by `tokenizers`, a ChatML template with hermes tool calls, <|im_end|> as its end of sequence): the
    directory, for model.actor.model_name_or_path. A copy of the shipped one (SHIPPED_BPE) while its recipe is the
    recipe's now, else made; once per session, shared by the xdist workers (their common base directory, under a
    file lock)."""
    import shutil

    from filelock import FileLock

    from verlj_testing import SHIPPED_BPE, bpe_recipe

    recipe = bpe_recipe()
    root = tmp_path_factory.getbasetemp().parent  # every worker's basetemp is under it
    out = root / f"bpe_model-{recipe[:12]}"  # made anew when the recipe changes
    with FileLock(str(root / "bpe_model.lock")):
        if not (out / "model.safetensors").is_file():
            made = root / f"{out.name}.tmp"
            shutil.rmtree(made, ignore_errors=True)
            if (SHIPPED_BPE / "recipe.sha256").read_text().strip() == recipe:
                shutil.copytree(SHIPPED_BPE, made, ignore=shutil.ignore_patterns("recipe.sha256"))
            else:
                _recipe().make_bpe_model(made)
            made.rename(out)
    return str(out)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """The bpe_model's tokenizer alone (its byte-level BPE and ChatML template; the same, made in two seconds without the
    model's weights), for what needs no model."""
    return _recipe().make_tokenizer()


def _recipe():
    """examples/make_bpe_model.py, imported from the repository's root."""
    import importlib
    import sys

    sys.path.insert(0, str(REPO))
    try:
        return importlib.import_module("examples.make_bpe_model")
    finally:
        sys.path.remove(str(REPO))
