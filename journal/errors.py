"""The errors verlj raises for a user to act on. Each carries one sentence; the CLI prints it and exits.

:class:`VerljError` is the base of every one of them, the journal's and the engine's alike (the CLI
catches it and nothing narrower): it lives here, at the bottom of the floor plan, so that both stand on it.
"""


class VerljError(Exception):
    """Something a user must act on, said in one sentence. `exit_code`: what the CLI exits with."""

    exit_code = 1


class JournalError(VerljError):
    """Base class: something about the journal a user must act on."""


class CodecError(JournalError):
    """A value cannot be encoded, or stored bytes cannot be decoded."""


class SchemaError(JournalError):
    """A record or event has a schema this code does not understand."""


class StepOrderError(JournalError):
    """A step was appended out of order (gap, repeat, or going back)."""


class JournalLockedError(JournalError):
    """Another process holds the journal for writing."""


class NotAJournalError(JournalError):
    """The path holds no journal."""
