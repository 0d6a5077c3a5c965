"""act(gate) * up read only by a quantized matmul: one FUSED "glu_gemv" op, which the word GEMV runs
with act(gate) * up computed as it loads x (the down projection of a gated feed-forward), act silu
(SwiGLU: Llama, Qwen) or gelu with approximate="tanh" (GeGLU: Gemma); see gemv_rules.gate_activation.

Only where the word GEMV takes the matmul (float32 rows, at most `words_max_rows`, a word-layout
weight); elsewhere the product stays an elementwise region and the matmul its own step."""
from __future__ import annotations

from .. import dtypes as dt
from ..ir import Op, Program, consumers
from .fusion import Match, fuse_matches
from .gemv_rules import WORDS_MAX_ROWS, gate_activation, rows, word_layout


def fuse_glu(program: Program, words_max_rows: int = WORDS_MAX_ROWS) -> tuple[Program, bool]:
    """Replace act(a) * b -> quantized_matmul by FUSED nodes; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches = []
    for m in nodes:
        if m.op != Op.QUANTIZED_MATMUL or not word_layout(m) or m.src[0].dtype != dt.float32:
            continue
        mul = m.src[0]
        if mul.op != Op.MUL or mul.id in roots or len(users[mul.id]) != 1 or any(s is mul for s in m.src[1:]):
            continue
        act = next((s for s in mul.src if gate_activation(s) is not None), None)
        if act is None or act.id in roots or len(users[act.id]) != 1 or not mul.type.static:
            continue
        up = mul.src[1] if mul.src[0] is act else mul.src[0]
        if up.type.shape != act.src[0].type.shape or not 1 <= (rows(m) or 0) <= words_max_rows:
            continue
        matches.append(Match("glu_gemv", [act, mul, m], [m]))
    return fuse_matches(program, matches)
