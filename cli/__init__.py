"""verlj.cli: the typer command-line app (`verlj ...` and `python -m verlj.cli ...`)."""

import verlj.engine  # noqa: F401  (declares verlj's journal event types: `verlj journal ...` reads journals through verlj.journal alone)
