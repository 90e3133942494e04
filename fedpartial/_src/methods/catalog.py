"""Methods by name: :data:`METHODS` maps each built-in one to its self-describing
:class:`~fedpartial._src.methods.registry.MethodSpec` (factory, options, summary); other packages add
theirs through the entry-point group :data:`ENTRY_POINT_GROUP`, and any method can be named as
``package.module:factory``.  ``find_method`` resolves a name, :func:`get_method` builds one with
checked options.
"""

import dataclasses
import functools
import importlib
import inspect
from importlib import metadata
from typing import Any, Callable

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Method
from fedpartial._src.methods.adaptive import fedad as _fedad
from fedpartial._src.methods.basic import feddyn as _feddyn
from fedpartial._src.methods.basic import fedavg as _fedavg
from fedpartial._src.methods.basic import fednova as _fednova
from fedpartial._src.methods.basic import fedprox as _fedprox
from fedpartial._src.methods.basic import moon as _moon
from fedpartial._src.methods.basic import scaffold as _scaffold
from fedpartial._src.methods.layerwise import fedldf as _fedldf
from fedpartial._src.methods.layerwise import fedpart as _fedpart
from fedpartial._src.methods.lora import fedit as _fedit
from fedpartial._src.methods.lora import fedsa_lora as _fedsa_lora
from fedpartial._src.methods.lora import ffa_lora as _ffa_lora
from fedpartial._src.methods.lora import flexlora as _flexlora
from fedpartial._src.methods.lora import hetlora as _hetlora
from fedpartial._src.methods.lora import flora as _flora
from fedpartial._src.methods.personal import ditto as _ditto
from fedpartial._src.methods.personal import fedbabu as _fedbabu
from fedpartial._src.methods.personal import fedbn as _fedbn
from fedpartial._src.methods.personal import fedper as _fedper
from fedpartial._src.methods.personal import fedrep as _fedrep
from fedpartial._src.methods.personal import lgfedavg as _lgfedavg
from fedpartial._src.methods.registry import MethodSpec, Option, boolean, is_boolean
from fedpartial._src.methods.submodel import afd as _afd
from fedpartial._src.methods.submodel import dropout as _dropout
from fedpartial._src.methods.submodel import feddst as _feddst
from fedpartial._src.methods.submodel import fedselect as _fedselect
from fedpartial._src.methods.submodel import fiarse as _fiarse
from fedpartial._src.methods.submodel import fedspu as _fedspu
from fedpartial._src.methods.tiered import depthfl as _depthfl
from fedpartial._src.methods.tiered import embracingfl as _embracingfl
from fedpartial._src.methods.tiered import fedrolex as _fedrolex
from fedpartial._src.methods.tiered import heterofl as _heterofl
from fedpartial._src.methods.tiered import inclusivefl as _inclusivefl
from fedpartial._src.methods.weighting import feddh as _feddh

#: name -> MethodSpec, in the order ``fedpartial list methods`` lists them
METHODS: dict[str, MethodSpec] = {
    spec.name: spec for spec in (
        _fedavg.SPEC, _fedprox.SPEC, *_fedldf.SPECS, _fedspu.SPEC, *_dropout.SPECS, _afd.SPEC, _fedselect.SPEC,
        _embracingfl.SPEC, _heterofl.SPEC, _fedrolex.SPEC, _depthfl.SPEC, _inclusivefl.SPEC,
        _fedper.SPEC, _lgfedavg.SPEC, _fedrep.SPEC, _fedbn.SPEC, _fedbabu.SPEC, _ditto.SPEC,
        *_feddh.SPECS, *_fedad.SPECS,
        _fednova.SPEC, _moon.SPEC, _feddyn.SPEC, _scaffold.SPEC, _feddst.SPEC, _fedpart.SPEC, _fiarse.SPEC,
        _fedit.SPEC, _ffa_lora.SPEC, _fedsa_lora.SPEC, _hetlora.SPEC, _flexlora.SPEC, _flora.SPEC,
    )
}


#: entry-point group through which other packages offer methods: ``[project.entry-points."fedpartial.methods"]``,
#: ``name = "package.module:SPEC"`` (a MethodSpec) or ``"package.module:factory"`` (a function returning a Method)
ENTRY_POINT_GROUP = "fedpartial.methods"


def _options_of(factory: Callable) -> tuple[Option, ...]:
    """A plain factory's keyword arguments with int, float, bool or str defaults, as options (their flags
    are ``--name``); arguments without such a default are not options."""
    options = []
    for param in inspect.signature(factory).parameters.values():
        default = param.default
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) or default is param.empty:
            continue
        kind = type(default)
        if kind in (int, float, str):
            options.append(Option(param.name, kind, default, f"{factory.__name__}'s {param.name}"))
        elif kind is bool:
            options.append(Option(param.name, boolean, default, f"{factory.__name__}'s {param.name}", is_boolean))
    return tuple(options)


def as_spec(obj: Any, name: str) -> MethodSpec:
    """``obj`` (a MethodSpec, or a factory returning a Method) as a MethodSpec; ``name`` names it in messages.

    A plug-in MethodSpec's factory arguments that its options do not describe (nor its ``run_settings``)
    become options as a plain factory's do, so each has a flag as the built-in methods' options have."""
    if isinstance(obj, MethodSpec):
        taken = {o.name for o in obj.options} | set(obj.run_settings)
        extra = tuple(o for o in _options_of(obj.factory) if o.name not in taken)
        return dataclasses.replace(obj, options=obj.options + extra) if extra else obj
    if callable(obj):
        summary = (inspect.getdoc(obj) or f"{name} (a method from another package)").splitlines()[0]
        return MethodSpec(name, obj, summary, options=_options_of(obj))
    raise UserError(f"method {name!r} is a {type(obj).__name__}, not a MethodSpec or a factory returning a Method.")


def _load(reference: str) -> Any:
    """The object ``package.module:attribute`` names; a bad reference is one sentence."""
    module_name, _, attribute = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"method {reference!r}: module {module_name!r} cannot be imported ({e}).") from None
    try:
        return functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise UserError(f"method {reference!r}: module {module_name!r} has no {attribute!r}.") from None


def installed_methods() -> dict[str, MethodSpec]:
    """Methods other packages register under :data:`ENTRY_POINT_GROUP` (a built-in name is never shadowed)."""
    found = {}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name not in METHODS and entry.name not in found:
            found[entry.name] = as_spec(_load(entry.value), entry.name)
    return found


def all_methods() -> dict[str, MethodSpec]:
    """Every method a name can reach: the built-in ones, then the installed ones."""
    return {**METHODS, **installed_methods()}


def find_method(name: str) -> MethodSpec:
    """The method ``name`` names: built in, installed (entry point) or ``package.module:attribute``."""
    if name in METHODS:
        return METHODS[name]
    if ":" in name:
        return as_spec(_load(name), name)
    installed = installed_methods()
    if name in installed:
        return installed[name]
    known = ", ".join([*METHODS, *installed])
    raise UserError(f"method {name!r} is unknown; choose one of {known}, or name one of your own as "
                    "package.module:factory.")


def get_method(name: str, **options) -> Method:
    """Builds a method by name (see ``find_method``) with checked options; bad names or values raise a
    one-sentence UserError.

    Args:
      name: a registered method name (``fedpartial list methods``) or ``module:factory``.
      **options: the method's options (its :class:`~fedpartial.Option` s), checked.

    Returns:
      The :class:`~fedpartial.Method`.

    Raises:
      UserError: an unknown name or an option value the method refuses.

    Examples:
      >>> from fedpartial.methods import get_method
      >>> get_method("fedldf", n=4).name
      'fedldf'
    """
    return find_method(name).build(**options)
