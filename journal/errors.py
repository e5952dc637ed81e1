"""Errors raised by the journal. Each carries one sentence meant for a user."""


class JournalError(Exception):
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
