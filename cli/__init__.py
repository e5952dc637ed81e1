"""verlj.cli: the typer command-line app (`verlj ...` and `python -m verlj.cli ...`)."""
