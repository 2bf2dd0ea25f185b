"""The base class of every problem a user can fix: a job reports it as one message, without a
traceback, and exits 2 (nothing ran). Each module raises its own subclass, in its own words."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's configuration, data, model, environment or run folder; the
    message says what is wrong and how to fix it."""
