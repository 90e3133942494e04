"""Methods written outside fedpartial, on its public API alone (``examples.scaffold``)."""
