"""fedpartial: federated learning with partial model training, one jitted function per round.

The cohort is one stacked parameter pytree with a leading client axis; per-client
structured masks say what each client trains, keeps and uploads.
"""

__version__ = "0.1.0"
