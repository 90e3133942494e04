"""Federated methods, each a short module on :mod:`fedpartial.methods.base`.

:data:`METHODS` maps every registered name to its self-describing
:class:`~fedpartial.methods.registry.MethodSpec` (factory, options, summary);
:func:`get_method` builds one with checked options.
"""

from fedpartial.errors import UserError
from fedpartial.methods import afd as _afd
from fedpartial.methods import dropout as _dropout
from fedpartial.methods import embracingfl as _embracingfl
from fedpartial.methods import fedad as _fedad
from fedpartial.methods import fedavg as _fedavg
from fedpartial.methods import feddh as _feddh
from fedpartial.methods import feddst as _feddst
from fedpartial.methods import feddyn as _feddyn
from fedpartial.methods import fedldf as _fedldf
from fedpartial.methods import fednova as _fednova
from fedpartial.methods import fedprox as _fedprox
from fedpartial.methods import fedselect as _fedselect
from fedpartial.methods import fedspu as _fedspu
from fedpartial.methods import heterofl as _heterofl
from fedpartial.methods import moon as _moon
from fedpartial.methods.afd import afd
from fedpartial.methods.base import (
    Batch,
    ClientGroup,
    ClientPlan,
    CohortInfo,
    InitView,
    LocalStep,
    LossAux,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    cohort_rows,
    cross_entropy,
    gather_clients,
    make_method,
    scatter_clients,
    with_penalty,
)
from fedpartial.methods.dropout import feddrop, fedmp, fjord, hermes, prunefl
from fedpartial.methods.early_stopping import early_stopping
from fedpartial.methods.embracingfl import embracingfl
from fedpartial.methods.fedad import fedad, feddhad
from fedpartial.methods.fedavg import fedavg
from fedpartial.methods.feddh import feddh, feddhe, fedjs, reweight
from fedpartial.methods.feddst import feddst
from fedpartial.methods.feddyn import feddyn
from fedpartial.methods.fedldf import fedadp, fedldf, hdfl, random_layers
from fedpartial.methods.fednova import fednova
from fedpartial.methods.fedprox import fedprox
from fedpartial.methods.fedselect import fedselect
from fedpartial.methods.fedspu import fedspu
from fedpartial.methods.heterofl import heterofl
from fedpartial.methods.moon import moon
from fedpartial.methods.registry import MethodSpec, Option

#: name -> MethodSpec, in the order ``fedpartial methods`` lists them
METHODS: dict[str, MethodSpec] = {
    spec.name: spec for spec in (
        _fedavg.SPEC, _fedprox.SPEC, *_fedldf.SPECS, _fedspu.SPEC, *_dropout.SPECS, _afd.SPEC, _fedselect.SPEC,
        _embracingfl.SPEC, _heterofl.SPEC,
        *_feddh.SPECS, *_fedad.SPECS,
        _fednova.SPEC, _moon.SPEC, _feddyn.SPEC, _feddst.SPEC,
    )
}


def get_method(name: str, **options) -> Method:
    """Builds a registered method with checked options; bad names or values raise a one-sentence UserError."""
    if name not in METHODS:
        raise UserError(f"method {name!r} is unknown; choose one of {', '.join(METHODS)}.")
    return METHODS[name].build(**options)


__all__ = [
    "Batch", "ClientGroup", "ClientPlan", "CohortInfo", "InitView", "LocalStep", "LossAux", "METHODS", "Method",
    "MethodContext", "MethodSpec", "MethodState", "Option", "RoundView", "Selection", "cohort_rows", "cross_entropy",
    "early_stopping", "embracingfl", "fedadp", "fedavg", "feddrop", "fedldf", "fedmp", "fedprox", "fedselect", "fedspu", "fjord",
    "gather_clients", "get_method", "hdfl", "hermes", "make_method", "prunefl", "random_layers",
    "scatter_clients", "with_penalty",
    "feddh", "feddhe", "fedjs", "reweight",
    "fedad", "feddhad",
    "heterofl",
    "afd",
    "feddst", "feddyn", "fednova", "moon",
]
