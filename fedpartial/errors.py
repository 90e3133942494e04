"""The one exception type for bad input from the person running fedpartial.

A :class:`UserError` carries one sentence naming the bad value and what is
allowed; the command line prints it and exits with status 2.  Anything else that
goes wrong (a bug in a method, a model or the engine) keeps its traceback.
"""


class UserError(ValueError):
    """Invalid input (configuration, data, option, model choice): the message is for a person."""
