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


class NothingTrainedWarning(UserWarning):
    """A round in which the method's train masks selected no parameter of any client: the model cannot learn
    (a mask built from the wrong layer names or fractions).  Said once per run; the command line says it under
    the closing table instead."""


def warn_nothing_trained(round_number: int) -> bool:
    """Says :class:`NothingTrainedWarning` for round ``round_number`` (1-based); True, for a caller's flag."""
    import warnings

    warnings.warn(f"round {round_number}: the method's train masks selected no parameter of any client, so the "
                  f"model did not learn; check the layers or fractions its masks are built from.",
                  NothingTrainedWarning, stacklevel=3)
    return True
