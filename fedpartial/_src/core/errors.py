"""The one exception type for bad input from the person running fedpartial.

A :class:`UserError` carries one sentence naming the bad value and what is
allowed; the command line prints it and exits with status 2.  Anything else that
goes wrong (a bug in a method, a model or the engine) keeps its traceback.
"""


class UserError(ValueError):
    """Invalid input (configuration, data, option, model choice): the message is for a person."""


class DivergedError(UserError):
    """A run stopped because training diverged (every client's update, or the global model, became
    non-finite); the message names the round, and the simulation keeps the last finite state."""
