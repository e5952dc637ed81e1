"""The errors a user acts on in the engine. Each carries one sentence; the CLI prints it and exits
non-zero. All derive from verlj.journal's VerljError, the one class the CLI catches. Kept free of heavy
imports so every command can catch them without loading torch."""

from verlj.journal.errors import VerljError


class ConfigError(VerljError, ValueError):
    """A config problem: one sentence naming the key (exit code 2, like any usage error)."""

    exit_code = 2


class UsageError(VerljError, ValueError):
    """The command line asks for what cannot be done, found before anything runs: one sentence naming the option
    (exit code 2, as a config problem)."""

    exit_code = 2


class DataError(VerljError, ValueError):
    """The dataset cannot be used."""


class ModelError(VerljError, ValueError):
    """A model or tokenizer cannot be loaded."""


class RewardError(VerljError, ValueError):
    """A reward function cannot be loaded or returned something unusable."""


class RunError(VerljError, RuntimeError):
    """Something about the run directory a user must act on."""


class SnapshotError(VerljError, RuntimeError):
    """A snapshot is missing, damaged or unusable: names the file."""


class ReplayError(VerljError, RuntimeError):
    """Replay could not reproduce the journaled state."""


class HardwareDivergence(ReplayError):
    """A replay that differs from the journal where the step was trained on other hardware (another CPU
    kernel level, device or BLAS: state.hardware): not damage, as bitwise equality is not promised there."""


class PluginError(VerljError, ValueError):
    """User code named in the config (a checkpoint policy) cannot be loaded or misbehaved: names it."""


def loading(error: type[VerljError]) -> type[VerljError]:
    """`error` as a ConfigError too (exit 2: the CLI reference's rule): code the config names that cannot
    be imported or has the wrong signature is bad input, as a wrong key is, whatever names it (what
    plugins.import_object and check_signature are given to raise)."""
    if issubclass(error, ConfigError):
        return error
    if error not in _LOADING:
        _LOADING[error] = type(error.__name__, (error, ConfigError), {"__module__": error.__module__})
    return _LOADING[error]


_LOADING: dict[type[VerljError], type[VerljError]] = {}


def install_hint(extra: str) -> str:
    """How to install an optional extra, for a message: from an index, and from a checkout (where
    ``pip install 'verlj[X]'`` would fetch the published package instead of the tree at hand)."""
    return f"pip install 'verlj[{extra}]' (in a checkout: pip install -e '.[{extra}]')"
