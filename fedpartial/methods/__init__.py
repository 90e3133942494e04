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
from fedpartial.methods.fedavg import fedavg
from fedpartial.methods.fedldf import fedadp, fedldf, hdfl, random_layers
from fedpartial.methods.fedprox import fedprox

#: name -> factory(**options) -> Method
METHODS = {
    "fedavg": fedavg,
    "fedprox": fedprox,
    "fedldf": fedldf,
    "random": random_layers,
    "hdfl": hdfl,
    "fedadp": fedadp,
}


def get_method(name: str, **options) -> Method:
    """Builds a registered method; unknown names raise a one-sentence ValueError."""
    if name not in METHODS:
        raise ValueError(f"method {name!r} is unknown; choose one of {', '.join(sorted(METHODS))}.")
    return METHODS[name](**options)


__all__ = [
    "Batch", "ClientPlan", "CohortInfo", "METHODS", "Method", "MethodContext", "MethodState",
    "RoundView", "Selection", "fedadp", "fedavg", "fedldf", "fedprox", "hdfl", "random_layers", "gather_clients", "get_method", "make_method",
    "scatter_clients",
]
