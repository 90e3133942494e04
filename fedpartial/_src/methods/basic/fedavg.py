"""FedAvg (McMahan et al. 2017): every client trains the whole model, the server
takes the ``n_k``-weighted mean.  With a server optimizer other than SGD(1) this is
FedOpt (FedAdam, FedYogi, FedAvgM) — the optimizer belongs to the engine.

Every default piece of :mod:`fedpartial._src.methods.base` *is* FedAvg, so the method
is just a name.
"""

from fedpartial._src.methods.base import Capabilities, Method, make_method
from fedpartial._src.methods.registry import MethodSpec


def fedavg() -> Method:
    """FedAvg: full-model local training, ``n_k``-weighted aggregation."""
    return make_method("fedavg", capabilities=Capabilities(streamable="per_client", asynchronous=True))


SPEC = MethodSpec("fedavg", fedavg, "Full-model training, n_k-weighted mean (FedOpt with --server-opt).")
