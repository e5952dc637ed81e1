"""verlj.engine: config, data, models, rollout, rewards, algorithms, DeepSpeed workers, trainer loop."""

__version__ = "0.1.0"
