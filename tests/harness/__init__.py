"""The test suite's harness: how its `verlj` runs, torchrun's ranks, async generators and Ray workers get their
processes. forkserver.py (the fork servers: torch, transformers, DeepSpeed and verlj imported once, a real process
forked per run), forkclient.py (a rank's or Ray worker's interpreter that asks a server for its process) and
processes.py (which server serves a run, or a fresh interpreter; what verlj_testing imports). README.md says what
the servers preload and patch, which library internals they touch, and how to turn them off (VERLJ_TESTS_FRESH=1)."""
