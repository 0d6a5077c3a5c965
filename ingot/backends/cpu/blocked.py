"""The FUSED "blocked" op (passes/block_channels.py): a conv of a chain kept in the channel-blocked layout
(ops/layout.py, [N, C/16, H, W, 16]), its body block_channels(conv(unblock_channels(x), ...)) with either
conversion absent where that side is NCHW. It runs as its conv's own kernel told which side is blocked:

- expand_depthwise.py: the pointwise conv reads 16 channels' blocks ([P, 16] a block) as it reads NCHW
  rows, a scalar per channel and position; the depthwise tiles store their 16-channel vectors straight into
  the output's block instead of a scratch transposed back into NCHW;
- conv_depthwise.py: a blocked input's rows are copied into the padded [H', W', 16] buffer (no transpose
  in); a blocked output is stored as the tiles compute it (no transpose out);
- conv_pointwise.py: a tile's accumulators (lanes: 16 output channels) stored as they are, the epilogue's
  residual read from a blocked operand the same way; a blocked input read per channel and position.
"""
from __future__ import annotations


from ...ir import Node, Op
from ...options import DEFAULT_CPU, CpuOptions
from ...passes.fuse_squeeze_excite import conv_of
from . import conv as conv_module
from . import conv_depthwise
from .expand_depthwise import expand_depthwise_lowering


def blocked_lowering(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    body = node.attrs["body"]
    (result,) = body.outputs
    blocked_out = result.op == Op.BLOCK_CHANNELS
    inner = result.src[0] if blocked_out else result
    blocked_in = {k for k, s in enumerate(inner.src) if s.op == Op.UNBLOCK_CHANNELS}
    if inner.op == Op.FUSED and inner.attrs.get("kind") == "expand_depthwise":
        first = [n for n in inner.attrs["body"].nodes if n.op in (Op.CONV, Op.FUSED)][0]
        image = first.src[0].attrs["param"]
        if blocked_in - {image}:
            return None
        return expand_depthwise_lowering(inner, out, options, image in blocked_in, blocked_out)
    found = conv_of(inner)
    if found is None or not conv_module.fast(found[0]):
        return None
    conv = found[0]
    if inner.op == Op.FUSED:
        epilogue = conv_module.Epilogue(inner.attrs["body"], conv)
        index = [s.attrs["param"] for s in conv.src]
    else:
        epilogue = conv_module.Epilogue(None, None)
        index = list(range(len(conv.src)))
    if not epilogue.spatial_ok or conv.type.rank != 4:
        return None
    x_i, w_i, b_i = index[0], index[1], index[2] if len(index) > 2 else None
    constants = frozenset(i for i, s in enumerate(node.src) if s.op == Op.CONSTANT)
    constant = w_i in constants and (b_i is None or b_i in constants)
    residuals = {i for form, i in epilogue.operands if form == "full"}
    if blocked_in - {x_i} - residuals or any((i in blocked_in) != blocked_out for i in residuals):
        return None
    w = conv.src[1].type.shape
    a = conv.attrs
    (sh, sw), ((ph, _), (pw, _)) = a["strides"], a["pads"]
    if a["groups"] == conv.src[0].type.shape[1] == w[0] and w[1] == 1 and \
            conv_depthwise.fits(w[2], w[3], a["strides"], a["dilations"], epilogue.operands):
        def build(part, target=None):
            return conv_depthwise.depthwise_step(part, target, epilogue, x_i, w_i, b_i, constant, (sh, sw, ph, pw),
                                                 constants, conv_module._operand, x_i in blocked_in, blocked_out)
    elif a["groups"] == 1 and tuple(w[2:]) == (1, 1) and (sh, sw) == (1, 1) and not any(p or q for p, q in a["pads"]):
        def build(part, target=None):
            return conv_module._spatial_step(part, target, epilogue, x_i, w_i, b_i, constant, None, "channels", constants,
                                             blocked_in=x_i in blocked_in, blocked_out=blocked_out)
    else:
        return None
    split = conv_module.threaded_step(conv, out, epilogue, x_i, w_i, b_i, options.resolved_threads, build,
                                      x_i in blocked_in, blocked_out) if options.resolved_threads > 1 else None
    return split or build(conv, out)


FUSED_LOWERINGS = {"blocked": blocked_lowering}
