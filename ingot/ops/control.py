"""Sources, state and calls: placeholder, constant, variable, assign, call, if, get_item."""
from __future__ import annotations

from ..errors import IngotError
from ..ir import Op, TensorType
from . import fail, register


def _source_rule(types, attrs):
    raise AssertionError("sources carry their own type")


def _no_reference(op):
    def ref(xs, attrs):
        raise IngotError(f"{op.name.lower()} has no standalone NumPy reference; the runtime executes it.")
    return ref


for _op in (Op.PLACEHOLDER, Op.CONSTANT, Op.VARIABLE):
    register(_op, _source_rule, _no_reference(_op))


def _assign_rule(types, attrs):
    var, value = types
    if var != value:
        raise fail(Op.ASSIGN, types, f"a value of the variable's type {var}")
    return var


register(Op.ASSIGN, _assign_rule, _no_reference(Op.ASSIGN))


def _call_rule(types, attrs):
    """The declared output types; their dynamic dimensions take the length that the inputs' dynamic
    dimensions all got once fed (an adapter's rows: x [T, in] -> [T, out]), else stay dynamic."""
    outputs = tuple(attrs["output_types"])
    declared = attrs.get("input_types", ())
    got = {t.shape[i] for d, t in zip(declared, types) if d.rank == t.rank for i, n in enumerate(d.shape) if n is None}
    if len(got) != 1 or None in got:
        return outputs
    (n,) = got
    return tuple(TensorType(tuple(n if d is None else d for d in o.shape), o.dtype) for o in outputs)


register(Op.CALL, _call_rule, _no_reference(Op.CALL))


def _if_rule(types, attrs):
    cond = types[0]
    if not isinstance(cond, TensorType) or not cond.static or cond.size != 1 or tuple(types[1:]) != tuple(attrs["input_types"]):
        raise fail(Op.IF, types, f"a condition of one value, then inputs {list(attrs['input_types'])}")
    return tuple(attrs["output_types"])


register(Op.IF, _if_rule, _no_reference(Op.IF))


def _get_item_rule(types, attrs):
    (outs,) = types
    if not isinstance(outs, tuple) or not 0 <= attrs["index"] < len(outs):
        raise fail(Op.GET_ITEM, [], f"an index into a call's {len(outs) if isinstance(outs, tuple) else 0} outputs")
    return outs[attrs["index"]]


register(Op.GET_ITEM, _get_item_rule, lambda xs, a: xs[0][a["index"]])
