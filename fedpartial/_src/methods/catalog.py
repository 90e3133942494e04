"""The built-in methods by name: :data:`METHODS` maps each to its self-describing
:class:`~fedpartial._src.methods.registry.MethodSpec` (factory, options, summary);
:func:`get_method` builds one with checked options.
"""

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Method
from fedpartial._src.methods.adaptive import fedad as _fedad
from fedpartial._src.methods.basic import feddyn as _feddyn
from fedpartial._src.methods.basic import fedavg as _fedavg
from fedpartial._src.methods.basic import fednova as _fednova
from fedpartial._src.methods.basic import fedprox as _fedprox
from fedpartial._src.methods.basic import moon as _moon
from fedpartial._src.methods.layerwise import fedldf as _fedldf
from fedpartial._src.methods.registry import MethodSpec
from fedpartial._src.methods.submodel import afd as _afd
from fedpartial._src.methods.submodel import dropout as _dropout
from fedpartial._src.methods.submodel import feddst as _feddst
from fedpartial._src.methods.submodel import fedselect as _fedselect
from fedpartial._src.methods.submodel import fedspu as _fedspu
from fedpartial._src.methods.tiered import embracingfl as _embracingfl
from fedpartial._src.methods.tiered import heterofl as _heterofl
from fedpartial._src.methods.weighting import feddh as _feddh

#: name -> MethodSpec, in the order ``fedpartial list methods`` lists them
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
