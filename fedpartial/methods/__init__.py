"""Federated methods, each a short module on :mod:`fedpartial.methods.base`."""

from fedpartial.methods.base import (
    Batch,
    ClientPlan,
    CohortInfo,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    gather_clients,
    make_method,
    scatter_clients,
)
from fedpartial.methods.dropout import feddrop, fedmp, fjord, hermes, prunefl
from fedpartial.methods.early_stopping import early_stopping
from fedpartial.methods.fedavg import fedavg
from fedpartial.methods.fedldf import fedadp, fedldf, hdfl, random_layers
from fedpartial.methods.fedprox import fedprox
from fedpartial.methods.fedselect import fedselect
from fedpartial.methods.fedspu import fedspu

#: name -> factory(**options) -> Method
METHODS = {
    "fedavg": fedavg,
    "fedprox": fedprox,
    "fedldf": fedldf,
    "random": random_layers,
    "hdfl": hdfl,
    "fedadp": fedadp,
    "fedspu": fedspu,
    "feddrop": feddrop,
    "fjord": fjord,
    "hermes": hermes,
    "fedmp": fedmp,
    "prunefl": prunefl,
    "fedselect": fedselect,
}

#: methods whose clients keep their own model (evaluated per client, on held-out data)
PERSONALISED = ("fedspu", "feddrop", "fjord", "hermes", "fedmp", "prunefl", "fedselect")


def get_method(name: str, **options) -> Method:
    """Builds a registered method; unknown names raise a one-sentence ValueError."""
    if name not in METHODS:
        raise ValueError(f"method {name!r} is unknown; choose one of {', '.join(sorted(METHODS))}.")
    return METHODS[name](**options)


__all__ = [
    "Batch", "ClientPlan", "CohortInfo", "METHODS", "Method", "MethodContext", "MethodState", "PERSONALISED",
    "RoundView", "Selection", "early_stopping", "fedadp", "fedavg", "feddrop", "fedldf", "fedmp", "fedprox",
    "fedselect", "fedspu", "fjord", "gather_clients", "get_method", "hdfl", "hermes", "make_method", "prunefl",
    "random_layers", "scatter_clients",
]
