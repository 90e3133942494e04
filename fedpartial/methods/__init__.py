"""The built-in federated methods, each a factory returning a :class:`fedpartial.Method`.

:data:`METHODS` maps every registered name to its self-describing :class:`fedpartial.MethodSpec`
(factory, options, summary); :func:`get_method` builds one by name with checked options.  The
pieces a method is written with (``make_method``, ``ClientPlan``, ``RoundView``, ...) are in
:mod:`fedpartial` itself; here are the helpers a new method is built from: the checks an ``Option`` declares
(:func:`at_least`, :func:`above`, :func:`between`, :func:`whole_number`, :func:`one_of`, :data:`probability`,
:data:`positive_int`, ...) and the personal-state pieces of FedPer and its kin (:func:`personal_parts`,
:func:`personal_layers`, :func:`merge`).
"""

from fedpartial._src.methods.adaptive.fedad import fedad, feddhad
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.feddyn import feddyn
from fedpartial._src.methods.basic.fednova import fednova
from fedpartial._src.methods.basic.fedprox import fedprox
from fedpartial._src.methods.basic.moon import moon
from fedpartial._src.methods.basic.scaffold import control_variates, scaffold
from fedpartial._src.methods.catalog import METHODS, get_method
from fedpartial._src.methods.codecs import upload_codec
from fedpartial._src.methods.layerwise.fedldf import fedadp, fedldf, hdfl, random_layers
from fedpartial._src.methods.layerwise.fedpart import fedpart
from fedpartial._src.methods.lora.fedit import fedit
from fedpartial._src.methods.lora.fedsa_lora import fedsa_lora
from fedpartial._src.methods.lora.ffa_lora import ffa_lora
from fedpartial._src.methods.lora.flexlora import flexlora
from fedpartial._src.methods.lora.hetlora import hetlora
from fedpartial._src.methods.lora.flora import flora
from fedpartial._src.methods.submodel.afd import afd
from fedpartial._src.methods.submodel.dropout import feddrop, fedmp, fjord, hermes, prunefl
from fedpartial._src.methods.personal.ditto import ditto
from fedpartial._src.methods.personal.fedbabu import fedbabu
from fedpartial._src.methods.personal.fedbn import fedbn
from fedpartial._src.methods.personal.fedper import fedper
from fedpartial._src.methods.personal.fedrep import fedrep
from fedpartial._src.methods.personal.lgfedavg import lgfedavg
from fedpartial._src.methods.personal.parts import personal_layers, personal_parts
from fedpartial._src.methods.option_checks import (
    above,
    at_least,
    between,
    in_unit_interval,
    one_of,
    positive_int,
    probability,
    rate,
    whole_number,
)
from fedpartial._src.methods.submodel.common import merge
from fedpartial._src.methods.submodel.feddst import feddst
from fedpartial._src.methods.submodel.fedselect import fedselect
from fedpartial._src.methods.submodel.fiarse import fiarse
from fedpartial._src.methods.submodel.fedspu import fedspu
from fedpartial._src.methods.tiered.depthfl import depthfl
from fedpartial._src.methods.tiered.embracingfl import embracingfl
from fedpartial._src.methods.tiered.fedrolex import fedrolex
from fedpartial._src.methods.tiered.heterofl import heterofl
from fedpartial._src.methods.tiered.inclusivefl import inclusivefl
from fedpartial._src.methods.weighting.feddh import feddh, feddhe, fedjs

__all__ = [
    "METHODS", "get_method", "upload_codec",
    "fedavg", "fedprox", "fednova", "feddyn", "moon", "scaffold", "control_variates",
    "fedldf", "random_layers", "hdfl", "fedadp", "fedpart",
    "fedspu", "feddrop", "fjord", "hermes", "fedmp", "prunefl", "afd", "fedselect", "feddst", "fiarse",
    "embracingfl", "heterofl", "fedrolex", "depthfl", "inclusivefl",
    "fedper", "lgfedavg", "fedrep", "fedbn", "fedbabu", "ditto",
    "feddh", "fedjs", "feddhe",
    "fedad", "feddhad",
    "fedit", "ffa_lora", "fedsa_lora", "hetlora", "flexlora", "flora",
    # checks an Option declares
    "at_least", "above", "between", "whole_number", "one_of", "probability", "in_unit_interval", "rate",
    "positive_int",
    # personal state: what a client keeps, what it shares
    "personal_parts", "personal_layers", "merge",
]
