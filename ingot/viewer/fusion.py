"""Which ops each backend runs as one kernel, as groups of node ids (the viewer's outlined regions).

The compile pipeline is the same for every device: the `regions` pass records elementwise chains
on the program. What a backend makes of them differs:

  cpu   runs every node as its own step (NumPy, numba kernels); the compiler's fusions are single
        ops already (quantized_matmul = dequantize + matmul, sdpa), and regions are not fused.
  cuda  generates one Triton kernel per supported region, and its plan fuses a residual add with the
        rms_norm that reads it, a rope whose only reader writes it into a KV cache, and quantized
        matmuls that read the same input (one GEMV over their weights side by side). Those rules are
        restated here (torch-free, like CudaPlan in ingot/backends/cuda; benchmarks/viewer_cuda_groups.py
        checks them against a real plan); region support comes from the backend itself when it can
        be imported, else every pass region is shown.
"""
from __future__ import annotations

from typing import Any

from ..ir import Node, Op, Program, Ref, consumers

FLOATS = ("float32", "float16", "bfloat16")


def _cuda_region_check():
    import importlib.util
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return None  # importing torch alone takes seconds; without triton the backend cannot load
    try:
        from ..backends.cuda.fused import region_supported
    except Exception:  # no torch/triton here: every region the pass found is shown
        return None
    return region_supported


def kernel_groups(program: Program, device: str) -> dict[str, Any]:
    """{"groups": [{"nodes": [ids], "kind", "label"}], "note": str} for device "cpu" or "cuda"."""
    nodes = program.nodes()
    by_id = {n.id: n for n in nodes}
    regions = [[by_id[i] for i in r if i in by_id] for r in program.regions]
    label = lambda members: "+".join(m.op.name.lower() for m in members)  # noqa: E731
    if device == "cpu":
        note = (f"The CPU backend runs each node as one step; the regions pass found {len(regions)} elementwise "
                "group(s), which the CPU runs op by op. Fused ops: quantized_matmul, quantized_gather, sdpa.")
        return {"groups": [], "note": note, "pass_regions": len(regions)}
    if device != "cuda":
        return {"groups": [], "note": f"no kernel grouping known for device {device!r}", "pass_regions": len(regions)}
    supported = _cuda_region_check()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    groups = []
    for members in regions:
        if len(members) < 2 or any(m.id in roots for m in members[:-1]):
            continue
        if supported is not None and not supported(members):
            continue
        groups.append({"nodes": [m.id for m in members], "kind": "region", "label": "region " + label(members)})
    for n in nodes:
        if n.op == Op.ADD and n.id not in roots and n.dtype.name in FLOATS and n.type.rank >= 1 \
                and n.src[0].type.shape == n.src[1].type.shape == n.type.shape:
            norm = next((u for u in users[n.id] if u.op == Op.RMS_NORM and u.src[0] is n), None)
            if norm is not None:
                groups.append({"nodes": [n.id, norm.id], "kind": "add_rms_norm", "label": "add+rms_norm"})
        if n.op == Op.ROPE and n.id not in roots and len(users[n.id]) == 1:
            update = users[n.id][0]
            start = update.attrs.get("start", ())
            if update.op == Op.SLICE_UPDATE and update.attrs.get("inplace") and update.src[1] is n and \
                    len(start) >= 2 and isinstance(start[-2], Ref) and update.src[start[-2].index] is n.src[1]:
                groups.append({"nodes": [n.id, update.id], "kind": "rope_cache", "label": "rope written into the cache"})
    siblings: dict[int, list[Node]] = {}
    for n in nodes:
        if n.op == Op.QUANTIZED_MATMUL and n.attrs["mode"] == "affine" and all(s.op == Op.CONSTANT for s in n.src[1:]):
            siblings.setdefault(n.src[0].id, []).append(n)
    for members in siblings.values():
        if len(members) > 1 and len({m.dtype for m in members}) == 1:
            groups.append({"nodes": [m.id for m in members], "kind": "siblings",
                           "label": f"{len(members)} sibling quantized matmuls, one GEMV (when their formats concatenate)"})
    how = "the CUDA backend's region rule" if supported is not None else \
        "the regions pass alone (the CUDA backend needs torch and triton, not importable here)"
    note = (f"{sum(g['kind'] == 'region' for g in groups)} generated region kernel(s) chosen by {how}; "
            f"{sum(g['kind'] == 'add_rms_norm' for g in groups)} add+rms_norm and "
            f"{sum(g['kind'] == 'rope_cache' for g in groups)} rope-into-cache plan fusions"
            + (f"; {sum(g['kind'] == 'siblings' for g in groups)} sibling quantized-matmul group(s)." if siblings and
               any(g["kind"] == "siblings" for g in groups) else "."))
    return {"groups": groups, "note": note, "pass_regions": len(regions)}


def region_of(groups: list[dict[str, Any]]) -> dict[int, int]:
    return {i: k for k, g in enumerate(groups) for i in g["nodes"]}


__all__ = ["kernel_groups", "region_of"]
