"""The standby's head start (engine/loop/standby.py), in this process: the trainer a standby builds from its command,
and what a restart does with it. tests/integration/test_restarts.py has the supervised restarts that take it, and the
one whose run's config is another.

    python -m pytest -n 0 tests/integration/test_standby.py
"""

from __future__ import annotations

from verlj_testing import TINY


def test_the_standbys_trainer_is_taken_for_its_own_config_and_closed_for_another():
    """loop.standby in this process: the trainer a standby builds from the command is the one a restart takes when the
    run's config is the command's, every key alike; for another config (one key) it is closed and a new one built."""
    from verlj.engine.config import make_config
    from verlj.engine.loop.standby import prebuild, trainer_for

    said: list[str] = []
    for over, taken in ((TINY, True), ([*TINY, "model.actor.optim.lr=0.002"], False)):
        prebuilt = prebuild(None, TINY, said.append)
        assert prebuilt is not None and prebuilt.trainer is not None and said == []  # built, on this CPU, with memory to spare
        built = prebuilt.trainer
        trainer = trainer_for(make_config(None, over), built.rt, prebuilt, said.append)
        assert (trainer is built) == taken and hasattr(built, "actor") == taken  # another's: closed
        assert prebuilt.trainer is None  # let go either way
        assert trainer.cfg.model.actor.optim.lr == make_config(None, over).model.actor.optim.lr
        assert said.pop() == ("Took the trainer the standby built before the restart (models, DeepSpeed engines, data)." if taken else
                              "The standby built its trainer for the command's config, and the run's is another (a --resume changed it): "
                              "built the run's instead.")
        trainer.close()
