"""The trainer's end of the rollout generator's pipes (engine/rl/async_rollout.py), against a real pipe
and a real process that died: whichever end notices first, the run ends with the same one sentence.
(Under load, a trainer sent its next request before it read the closed result pipe and ended in
"error: [Errno 32] Broken pipe".)"""

import multiprocessing
import os

import pytest

from verlj.engine.errors import RunError
from verlj.engine.rl.async_rollout import GeneratorProcess


def _dead_generator(code: int) -> GeneratorProcess:
    ctx = multiprocessing.get_context("spawn")
    g = GeneratorProcess.__new__(GeneratorProcess)  # the pipes and the process only: no model behind them
    child_requests, g.requests = ctx.Pipe(duplex=False)
    g.results, child_results = ctx.Pipe(duplex=False)
    g.proc = ctx.Process(target=os._exit, args=(code,))
    g.proc.start()
    g.proc.join(30)
    child_requests.close()  # what the process held: gone with it
    child_results.close()
    return g


@pytest.mark.parametrize("use", ["send", "receive"])
def test_a_dead_generator_is_named_whichever_pipe_notices(use):
    g = _dead_generator(3)
    with pytest.raises(RunError) as err:
        if use == "send":
            g._send(("ask", [], {}, 1))
        else:
            g._reply(1.0)
    assert str(err.value).startswith(f"the rollout generator process (pid {g.proc.pid}) exited with code 3;"), str(err.value)
