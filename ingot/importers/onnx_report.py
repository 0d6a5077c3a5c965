"""Run ONNX's backend node test cases through the importer and report pass / fail / unsupported by op.

    python -m ingot.importers.onnx_report              # every case (~1,900): a table and the pass rates
    python -m ingot.importers.onnx_report Conv Gemm    # only the cases of these ops

Each case (from `onnx.backend.test.case.node`) is a model, its inputs and the expected outputs;
each runs through the public `from_onnx(case.model)` (ingot.from_onnx) and `run(inputs)`, nothing fixed by hand
(node tests pass shapes and axes as inputs: from_onnx then compiles per value at run), and passes
when every output has the expected dtype and shape and is within the case's own tolerance (rtol
1e-3, atol 1e-7 unless the case says otherwise, NaN equal to NaN, as onnx's backend runner checks). A case
is *unsupported* when the importer says so (UnsupportedOnnx: an op or attribute it does not
convert), and *failed* on any other error or a wrong value.

CLAIMED lists the ops the importer claims: every case that uses only claimed ops passes, which
tests/test_onnx_node.py checks in CI.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np

# ops whose every node test case passes (including those of other ops' cases that use only these)
CLAIMED = frozenset("""
Abs Acos Acosh Add AffineGrid ai.onnx.preview.training:Adagrad ai.onnx.preview.training:Adam
ai.onnx.preview.training:Momentum And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization
BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike CausalConvWithState Ceil Celu
CenterCropPad Clip Compress Concat Constant ConstantOfShape Conv ConvInteger ConvTranspose Cos Cosh CumProd
CumSum DepthToSpace DequantizeLinear Det DFT Div DynamicQuantizeLinear Einsum Elu Erf Exp Expand EyeLike
Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool Greater GreaterOrEqual
GridSample GroupNormalization GRU HammingWindow HannWindow Hardmax HardSigmoid HardSwish If
InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual LinearAttention Log LogSoftmax
LpNormalization LpPool LRN LSTM MatMul MatMulInteger Max MaxPool MaxUnpool Mean MeanVarianceNormalization Min
Mish Mod Mul Neg NegativeLogLikelihoodLoss NonMaxSuppression NonZero Not OneHot Or Pad Pow PRelu QLinearConv
QLinearMatMul QuantizeLinear Range
Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum
ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN RotaryEmbedding Round Scan Scatter
ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax SoftmaxCrossEntropyLoss
Softplus Softsign SpaceToDepth Split Sqrt Squeeze STFT Sub Sum SwiGLU Swish Tan Tanh TensorScatter
ThresholdedRelu Tile TopK Transpose Trilu Unique Unsqueeze Upsample Where Xor
""".split())


@dataclass
class CaseResult:
    name: str
    op: str            # the op under test
    ops: frozenset     # every op type the model uses
    status: str        # pass | fail | unsupported
    message: str = ""
    seconds: float = 0.0


def node_modules() -> list[str]:
    """The modules of onnx.backend.test.case.node, subpackages (ai_onnx_ml) included, as collect_testcases walks them."""
    import onnx
    import onnx.backend.test.case.node as node_pkg
    prefix = node_pkg.__name__ + "."
    names = []
    for _, name, is_pkg in pkgutil.walk_packages(node_pkg.__path__, prefix=prefix):
        name = name[len(prefix):]
        if name.startswith("ai_onnx_ml") and not onnx.ONNX_ML:
            continue
        if not is_pkg:
            names.append(name)
    return names


def collect(modules: list[str] | None = None) -> list[tuple[str, object]]:
    """(module, TestCase) for the node test cases of the given modules of onnx.backend.test.case.node
    (all when None). Importing a module runs its exports, which append its cases."""
    import onnx.backend.test.case.node as node_pkg

    found = []
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for name in modules if modules is not None else node_modules():
            before = len(node_pkg._NodeTestCases)
            importlib.import_module(f"{node_pkg.__name__}.{name}")
            found += [(name, case) for case in node_pkg._NodeTestCases[before:]]
    return found


def model_ops(model) -> frozenset:
    from .onnx import _all_nodes
    return frozenset(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}:{n.op_type}" for n in _all_nodes(model.graph))


def op_under_test(case, module_ops: dict[str, str], module: str) -> str:
    nodes = case.model.graph.node
    if len(nodes) == 1:
        return nodes[0].op_type
    return module_ops.get(module, module)


def _input_value(value):
    from onnx import TensorProto, numpy_helper
    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)   # int4 stays ml_dtypes.int4, as the case declares
    if isinstance(value, (list, tuple)):
        raise TypeError("sequence inputs")
    return np.asarray(value)


def run_case(case) -> tuple[str, str]:
    """('pass' | 'fail' | 'unsupported', message) for one node test case."""
    from ..errors import IngotError
    from .onnx import UnsupportedOnnx, from_onnx   # what ingot.from_onnx calls

    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            names = [vi.name for vi in case.model.graph.input]
            try:
                data = [({name: _input_value(v) for name, v in zip(names, inputs)}, [_input_value(v) for v in expected])
                        for inputs, expected in case.data_sets]
            except TypeError as e:
                return "unsupported", str(e)
            exe = from_onnx(case.model)   # the public entry, as a user calls it: nothing fixed by hand
            for feeds, expected in data:
                outputs = list(exe.run(feeds).values())
                if len(outputs) != len(expected):
                    return "fail", f"{len(outputs)} outputs, expected {len(expected)}"
                for i, (out, ref) in enumerate(zip(outputs, expected)):
                    if out.dtype != ref.dtype:
                        return "fail", f"output {i}: dtype {out.dtype}, expected {ref.dtype}"
                    if out.shape != ref.shape:
                        return "fail", f"output {i}: shape {out.shape}, expected {ref.shape}"
                    if ref.dtype == object:
                        ok = np.array_equal(out, ref)
                    else:
                        ok = np.allclose(out.astype(np.float64) if out.dtype.kind == "V" or out.dtype.name == "bfloat16" else out,
                                         ref.astype(np.float64) if ref.dtype.name == "bfloat16" else ref,
                                         rtol=case.rtol, atol=case.atol, equal_nan=True)
                    if not ok:
                        err = np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))) if out.size else 0
                        return "fail", f"output {i}: values differ (max abs error {err:.3g})"
    except UnsupportedOnnx as e:
        return "unsupported", str(e)
    except IngotError as e:
        return "fail", str(e)
    except Exception as e:  # a bug in a converter or the runtime: a failure, reported with its type
        return "fail", f"{type(e).__name__}: {e}"
    return "pass", ""


def run(modules: list[str] | None = None, ops: set[str] | None = None) -> list[CaseResult]:
    cases = collect(modules)
    module_ops: dict[str, str] = {}
    counts: dict[str, Counter] = {}
    for module, case in cases:
        if len(case.model.graph.node) == 1:
            counts.setdefault(module, Counter())[case.model.graph.node[0].op_type] += 1
    for module, c in counts.items():
        module_ops[module] = c.most_common(1)[0][0]
    results = []
    for module, case in cases:
        op = op_under_test(case, module_ops, module)
        if ops and op not in ops:
            continue
        start = time.perf_counter()
        status, message = run_case(case)
        results.append(CaseResult(case.name, op, model_ops(case.model), status, message, time.perf_counter() - start))
    return results


def claimed(result: CaseResult) -> bool:
    return result.ops <= CLAIMED


def summary(results: list[CaseResult]) -> str:
    by_op: dict[str, Counter] = {}
    for r in results:
        by_op.setdefault(r.op, Counter())[r.status] += 1
    lines = [f"{'op':<34}{'cases':>6}{'pass':>6}{'fail':>6}{'unsup':>6}  claimed"]
    for op in sorted(by_op, key=str.lower):
        c = by_op[op]
        lines.append(f"{op:<34}{sum(c.values()):>6}{c['pass']:>6}{c['fail']:>6}{c['unsupported']:>6}  {'yes' if op in CLAIMED else ''}")
    total = Counter(r.status for r in results)
    mine = [r for r in results if claimed(r)]
    mine_pass = sum(r.status == "pass" for r in mine)
    n = len(results)
    lines.append("")
    lines.append(f"all cases: {total['pass']}/{n} pass ({100 * total['pass'] / max(n, 1):.1f} %), {total['fail']} fail, "
                 f"{total['unsupported']} unsupported")
    lines.append(f"claimed-op cases (every op of the case claimed, {len(CLAIMED)} ops): {mine_pass}/{len(mine)} pass "
                 f"({100 * mine_pass / max(len(mine), 1):.1f} %)")
    lines.append(f"ops with every case passing: {sum(1 for c in by_op.values() if c['pass'] == sum(c.values()))} of {len(by_op)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv
    ops = {a for a in argv if not a.startswith("-")} or None
    start = time.perf_counter()
    results = run(None, ops)
    print(summary(results))
    print(f"({len(results)} cases in {time.perf_counter() - start:.1f} s)")
    if verbose:
        for r in results:
            if r.status != "pass":
                print(f"{r.status:<12}{r.name}: {r.message[:300]}")
    bad = [r for r in results if claimed(r) and r.status != "pass"]
    for r in bad:
        print(f"CLAIMED BUT {r.status.upper()}: {r.name}: {r.message[:300]}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
