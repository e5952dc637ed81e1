"""The errors a user acts on. Each carries one sentence; the CLI prints it and exits non-zero.
Kept free of heavy imports so every command can catch them without loading torch."""


class ConfigError(ValueError):
    """A config problem: one sentence naming the key (exit code 2)."""


class DataError(ValueError):
    """The dataset cannot be used."""


class ModelError(ValueError):
    """A model or tokenizer cannot be loaded."""


class RewardError(ValueError):
    """A reward function cannot be loaded or returned something unusable."""


class RunError(RuntimeError):
    """Something about the run directory a user must act on."""


class SnapshotError(RuntimeError):
    """A snapshot is missing, damaged or unusable: names the file."""


class ReplayError(RuntimeError):
    """Replay could not reproduce the journaled state."""


class PluginError(ValueError):
    """User code named in the config (a checkpoint policy) cannot be loaded or misbehaved: names it."""
