"""The fork servers (tests/harness/) stand in for fresh interpreters on a fixed sample of the suite's tests: a kill
and resume (test_recovery), an async run (test_async: its generator forked as the run starts), a vLLM run (test_vllm:
the server with vLLM imported) and a run on a Ray fleet (test_fleet: its cluster's actors forked through forkclient,
their episodes' env shipped by Ray's runtime env). The sample runs twice, each time in a pytest session of its own
(in this test's directory, under the same path): once with the fork servers, once with every process a fresh
interpreter (VERLJ_TESTS_FRESH=1). Each sample test passes both times; every `verlj` run it makes (VERLJ_TESTS_RUNLOG)
was forked the first time and fresh the second (and the second started no server at all, the first's cluster server
forked the fleet's actors); and each of those runs exits alike, prints the same lines about its steps, snapshots,
resumes and refusals (verlj_testing.RUN_LINES; the seconds a step took aside) and leaves the same journal, events and
fingerprints (assert_same_journal: timings aside, and on the fleet its own counters, which test_fleet sets aside
too). test_forkserver.py checks each of the harness's paths on its own; this is those paths together, on tests that
were written for the engine, not for the harness.

    python -m pytest -n 0 tests/integration/test_forked_as_fresh.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_fleet import NOT_FLEET

from harness import FRESH_SAMPLE
from verlj_testing import REPO, assert_same_journal, fingerprints

SAMPLE = FRESH_SAMPLE  # (conftest deselects them from a session that runs this module: the forked pass is their run)
IGNORE = {"fleet": NOT_FLEET}  # the fleet's own counters (deaths, groups asked again) hang on when Ray sees the actor die
PASSES = {"forked": "0", "fresh": "1"}  # VERLJ_TESTS_FRESH


@dataclass
class Pass:
    root: Path  # its pytest session's base directory (the sample's runs are under it)
    outcomes: dict[str, str]  # a test's name (as junit-xml writes it) -> passed, failed, error or skipped
    runs: list[dict]  # the runlog's lines for `verlj` runs, in order
    servers: list[dict]  # the runlog's lines for fork servers stopped
    output: str  # the session's stdout and stderr, ends
    seconds: float  # the session's, start to end

    def outcome(self, nodeid: str) -> str:
        return self.outcomes.get(nodeid.partition("::")[2], "not run")

    def runs_of(self, nodeid: str) -> list[dict]:
        """The runs the test `nodeid` made, its fixtures' included."""
        return [r for r in self.runs if r["test"].rpartition(" (")[0] == nodeid]


def run_pass(root: Path, how: str) -> Pass:
    """The sample, run in a pytest session of its own with VERLJ_TESTS_FRESH as `how` says, its base directory at
    root/session (the path each pass's runs have: what a run writes down of its path is the same in both) and then
    moved to root/HOW."""
    session, log, xml = root / "session", root / f"{how}.runlog", root / f"{how}.xml"
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}  # a session of its own
    e.update(VERLJ_TESTS_FRESH=PASSES[how], VERLJ_TESTS_RUNLOG=str(log))
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rfEs", f"--basetemp={session}",
           f"--junitxml={xml}", *SAMPLE.values()]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=e, timeout=1500)
    seconds = time.monotonic() - started
    if session.is_dir():  # (a session that could not start made none: its output says why)
        session.rename(root / how)
    outcomes = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            found = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = found[0] if found else "passed"
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return Pass(root / how, outcomes, [x for x in lines if "args" in x], [x for x in lines if "server" in x],
                (out.stdout + out.stderr)[-6000:], seconds)


@pytest.fixture(scope="module")
def passes(tmp_path_factory) -> dict[str, Pass]:
    root = tmp_path_factory.mktemp("passes")
    out = {how: run_pass(root, how) for how in PASSES}
    print(", ".join(f"{how} pass {p.seconds:.0f} s" for how, p in out.items()))  # what the check costs (pytest -rP shows it)
    return out


def said(run: dict) -> list[str]:
    """What the run printed about how it went, less the seconds each step took and pids."""
    return [re.sub(r"pid \d+", "pid N", re.sub(r"time=[\d.]+s", "time=T", line)) for line in run["said"]]


def output_dirs(runs: list[dict]) -> list[str]:
    """The run directories `verlj train --output-dir DIR` was given, each once, in order."""
    dirs = [r["args"][r["args"].index("--output-dir") + 1] for r in runs if "--output-dir" in r["args"]]
    return list(dict.fromkeys(dirs))


@pytest.mark.parametrize("name", list(SAMPLE))
def test_a_sample_test_passes_forked_and_fresh_and_its_runs_are_the_same(passes, name):
    nodeid, forked, fresh = SAMPLE[name], passes["forked"], passes["fresh"]
    if forked.outcome(nodeid) == fresh.outcome(nodeid) == "skipped" and not os.environ.get("CI"):
        pytest.skip(f"{nodeid} skipped in both passes (its optional library is not installed)")
    assert (forked.outcome(nodeid), fresh.outcome(nodeid)) == ("passed", "passed"), f"forked:\n{forked.output}\nfresh:\n{fresh.output}"
    runs = {how: p.runs_of(nodeid) for how, p in passes.items()}
    assert runs["forked"], f"{nodeid} made no `verlj` run"
    assert "fresh" not in {r["by"] for r in runs["forked"]}, runs["forked"]  # every one forked by a server
    assert {r["by"] for r in runs["fresh"]} == {"fresh"}
    for a, b in zip(runs["forked"], runs["fresh"], strict=True):  # the same runs, in the same order: same exits and lines
        assert (a["args"], a["ranks"], a["code"]) == (b["args"], b["ranks"], b["code"])
        assert said(a) == said(b), (a["args"], said(a), said(b))
    dirs = output_dirs(runs["forked"])
    assert dirs
    session = forked.root.parent / "session"
    for run in dirs:
        rel = Path(run).relative_to(session)
        assert fingerprints(forked.root / rel) and fingerprints(forked.root / rel) == fingerprints(fresh.root / rel), rel
        assert_same_journal(forked.root / rel, fresh.root / rel, ignore=IGNORE.get(name, ()))


def test_the_forked_pass_forked_and_the_fresh_pass_started_no_server(passes):
    """The comparison above is between forks and fresh interpreters, not between two of a kind: the forked pass's
    servers forked its runs (and, on the fleet's cluster, its actors), the fresh pass started none."""
    assert passes["fresh"].servers == []
    forked = passes["forked"].servers
    assert {s["server"] for s in forked} >= {"plain"}, forked
    assert sum(s["forked"].get("verlj.cli", 0) for s in forked) >= len(passes["forked"].runs)
    fleet = [s for s in forked if s["test"].rpartition(" (")[0] == SAMPLE["fleet"]]
    if passes["forked"].outcome(SAMPLE["fleet"]) != "skipped":
        assert fleet and sum(s["forked"].get("default_worker.py", 0) for s in fleet) >= 2, forked  # its two actors at least
