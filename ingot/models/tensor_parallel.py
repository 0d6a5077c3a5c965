"""A decoder split over ranks (tensor parallelism): its weights cut by passes/shard.shard_weights, its
graph built by the family's builder from the narrowed config, then given its collectives by the
pass passes/shard.insert_collectives, checked and verified.

    >>> model = build_sharded(cfg, tensors, world=2, rank=0)        # doctest: +SKIP
    >>> model.compile(1).run({"tokens": ids, "pos": np.int32(0), "last": np.int32(0)})   # in a group of 2  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable

from .. import models
from ..errors import IngotError
from ..graph import Graph, Tensor
from ..ir import Op, Program
from ..passes.shard import check_tensor_parallel, collective_chain, insert_collectives, shard_weights
from ..verify import verify


def shard_decoder(model, world: int, rank: int):
    """The DecoderGraph `model` (built from shard_weights' config and tensors) with its collectives:
    a new DecoderGraph whose graph is checked (one all_reduce after each layer's o and down, one for
    the embedding, one all_gather of the logits, in one chain) and verified."""
    g = model.graph
    if any(n.op == Op.CALL for n in Program([model.logits.node], list(g.assigns)).nodes()):
        raise IngotError("tensor parallel: adapters (LoRA, error compensation) are not supported yet.")
    program = Program([model.logits.node], list(g.assigns), dict(g.constants), dict(g.variables))
    program, _ = insert_collectives(program, world, rank)
    verify(program)
    chain = collective_chain(program)
    reduces = sum(n.op == Op.ALL_REDUCE for n in chain)
    gathers = sum(n.op == Op.ALL_GATHER for n in chain)
    layers = model.config.n_layers
    if (reduces, gathers) != (2 * layers + 1, 1):
        raise IngotError(f"tensor parallel: the {model.config.family} graph got {reduces} all_reduce and {gathers} "
                         f"all_gather ops; {layers} layers need {2 * layers + 1} and 1.")
    sharded = Graph()
    sharded.constants, sharded.variables = program.constants, program.variables
    sharded.assigns, sharded.placeholders = list(program.assigns), dict(g.placeholders)
    sharded.variable_nodes = dict(g.variable_nodes)
    return dataclasses.replace(model, graph=sharded, logits=Tensor(sharded, program.outputs[0]),
                               tokens=Tensor(sharded, model.tokens.node), pos=Tensor(sharded, model.pos.node),
                               last=Tensor(sharded, model.last.node), inputs={})


def build_sharded(cfg, tensors: Mapping, world: int, rank: int, path: str = "", builder: Callable | None = None, **kwargs):
    """Rank `rank`'s decoder of `world`: its weights sliced, its graph built and given collectives.
    world 1 is the plain decoder."""
    build = builder or models.build
    if world == 1:
        check_tensor_parallel(cfg, world)
        return build(cfg, tensors, path, **kwargs)
    local_cfg, local = shard_weights(cfg, tensors, world, rank)
    return shard_decoder(build(local_cfg, local, path, **kwargs), world, rank)
