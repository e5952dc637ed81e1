"""The test suite's harness: how its `verlj` runs, torchrun's ranks, async generators and Ray workers get their
processes. forkserver.py (the fork servers: torch, transformers, DeepSpeed and verlj imported once, a real process
forked per run), forkclient.py (a rank's or Ray worker's interpreter that asks a server for its process) and
processes.py (which server serves a run, or a fresh interpreter; what verlj_testing imports). README.md says what
the servers preload and patch, which library internals they touch, and how to turn them off (VERLJ_TESTS_FRESH=1)."""

# The fixed sample of the suite's tests that test_forked_as_fresh.py runs twice, in pytest sessions of its own: with the
# fork servers and in fresh interpreters (a kill and resume, an async run, a vLLM run, a run on a Ray fleet). Where that
# module runs, these run there only (conftest deselects them from the session: its forked pass is their run).
FRESH_SAMPLE = {
    "kill-resume": "tests/integration/test_recovery.py::test_kills_at_failpoints_then_resume_is_exact[grpo-journal.before_commit:3-snapshot.rotate:1]",
    "async": "tests/integration/test_async.py::test_the_journal_records_versions_plans_and_the_off_policy_metrics",
    "vllm": "tests/integration/test_vllm.py::test_the_journal_names_the_engine",
    "fleet": "tests/integration/test_fleet.py::test_episodes_on_a_fleet_in_step_order_are_bit_identical_through_a_killed_actor_and_trainer",
}

# The tests of extras that do not install beside `dev` (verifiers 0.4 pins openai<3; dev's openai-agents needs openai>=3),
# by extra (its name is its package's), as files or test ids under tests/: conftest leaves them out of a session where
# the extra's package is not importable, and tools/extras.py (.ci/run calls it) runs them in a venv with the extra
# installed as a user installs it.
# What tools/extras.py installs for each (`pip install -e '.[EXTRAS]'`): the extras it goes beside in its tests.
APART_INSTALL = {"verifiers": "verifiers,vllm,ray"}
APART = {
    "verifiers": ["unit/test_verifiers_agent.py", "integration/test_verifiers_taskset.py",
                  "integration/test_examples.py::test_example_runs[verifiers_taskset]"],
    "langchain": ["integration/test_langchain_mcp.py"],
}
# Of those, the agent programs that run in an interpreter of their own beside verlj's (a `cmd:` agent): what tools/extras.py
# installs in that interpreter's venv (no verlj: LangChain's MCP adapters pin mcp<2, and verlj's tools server is mcp 2's);
# their tests run in the suite's own interpreter with VERLJ_TESTS_AGENT_PYTHON naming the venv's python, and conftest
# leaves them out of a session without it.
AGENT_SIDE = {"langchain": ["langchain-openai>=1", "langchain-mcp-adapters>=0.3"]}
