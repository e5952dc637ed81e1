"""verlj.engine: config, data, models, rollout, rewards, algorithms, DeepSpeed workers, trainer loop."""

from . import schema as schema  # declares verlj's journal event types (schema.events), whatever is imported first

__version__ = "0.1.0"
