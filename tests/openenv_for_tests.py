"""examples/openenv_server.py's env, served by a process that dies (os._exit) at its N+1-th reset: an OpenEnv server
that goes down in the middle of a run (tests/integration/test_openenv.py).

    python tests/openenv_for_tests.py --port PORT --die-after N
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from openenv.core.env_server.http_server import create_app  # noqa: E402
from openenv_server import GuessAction, GuessEnvironment, GuessObservation  # noqa: E402

RESETS = [0]


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--die-after", type=int, required=True)
    args = parser.parse_args()

    class Dying(GuessEnvironment):
        def reset(self, seed=None, episode_id=None, **kwargs):
            RESETS[0] += 1
            if RESETS[0] > args.die_after:
                os._exit(1)
            return super().reset(seed, episode_id, **kwargs)

    app = create_app(Dying, GuessAction, GuessObservation, env_name="dying_guess", max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
