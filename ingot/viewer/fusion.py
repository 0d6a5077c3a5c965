"""Which ops each backend runs as one kernel, as groups of node ids (the viewer's outlined regions).

The viewer shows the program as compiled for the CPU. For another device it runs that device's own
fusion passes (compiler.DEVICE_PIPELINES, torch-free) on it and outlines each FUSED op's members, found
by the `origin` every rewritten node keeps; then the elementwise regions of what is left. Nothing here
restates a compiler rule: a new fusion pass shows up by itself.

  cpu   runs every node as its own step (NumPy, numba kernels); what its device pipeline fused
        (fuse_conv_epilogue) is already one FUSED node of the program shown.
  cuda  the fused ops of its pipeline, and one generated kernel per region the backend supports
        (asked of the backend when torch and triton import, else every region the pass found).
"""
from __future__ import annotations

from typing import Any

from ..ir import Node, Op, Program


def _cuda_region_check():
    import importlib.util
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return None  # importing torch alone takes seconds; without triton the backend cannot load
    try:
        from ..backends.cuda.fused import region_supported
    except Exception:  # no torch/triton here: every region the pass found is shown
        return None
    return region_supported


def _members(fused: Node) -> set[int]:
    """The origins of the nodes a fused op replaced, through nested fused ops."""
    out: set[int] = set()
    for n in fused.attrs["body"].nodes:
        if n.op == Op.FUSED:
            out |= _members(n)
        elif n.op != Op.PLACEHOLDER:
            out.add(n.origin)
    return out


def kernel_groups(program: Program, device: str) -> dict[str, Any]:
    """{"groups": [{"nodes": [ids], "kind", "label"}], "note": str, "pass_regions"} for a device."""
    from ..compiler import DEVICE_PIPELINES, device_steps
    from ..passes.regions import find_regions

    nodes = program.nodes()
    of_origin = {n.origin: n.id for n in nodes}    # the device passes keep origins: back to these nodes
    if device not in DEVICE_PIPELINES:
        return {"groups": [], "note": f"no kernel grouping known for device {device!r}", "pass_regions": len(program.regions)}
    if device == "cpu":
        kinds: dict[str, int] = {}
        counted = program
        if not any(n.op == Op.FUSED for n in nodes):   # a program compiled without device fusions (an LLM's)
            for _, step in device_steps("cpu"):
                counted, _ = step(counted)
        for n in counted.nodes():
            if n.op == Op.FUSED:
                kinds[n.attrs["kind"]] = kinds.get(n.attrs["kind"], 0) + 1
        fused = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())) or "none"
        note = (f"The CPU backend runs each node as one step; the regions pass found {len(program.regions)} elementwise "
                f"group(s), which the CPU runs op by op. Fused ops: quantized_matmul, quantized_gather, sdpa; from its "
                f"device pipeline: {fused}.")
        return {"groups": [], "note": note, "pass_regions": len(program.regions)}
    fused_program = program
    for _, step in device_steps(device):
        fused_program, _ = step(fused_program)
    groups = []
    for n in fused_program.nodes():
        if n.op == Op.FUSED:
            members = sorted({of_origin[o] for o in _members(n) if o in of_origin})
            if len(members) > 1:
                groups.append({"nodes": members, "kind": n.attrs["kind"], "label": n.attrs["kind"].replace("_", " ")})
    fused_program, _ = find_regions(fused_program)
    by_id = {n.id: n for n in fused_program.nodes()}
    roots = {n.id for n in fused_program.roots}
    supported = _cuda_region_check()
    label = lambda members: "+".join(m.op.name.lower() for m in members)  # noqa: E731
    regions = 0
    for region in fused_program.regions:
        members = [by_id[i] for i in region if i in by_id]
        if len(members) < 2 or any(m.id in roots for m in members[:-1]):
            continue
        if supported is not None and not supported(members):
            continue
        regions += 1
        groups.append({"nodes": sorted({of_origin[m.origin] for m in members if m.origin in of_origin}), "kind": "region",
                       "label": "region " + label(members)})
    how = "the CUDA backend's region rule" if supported is not None else \
        "the regions pass alone (the CUDA backend needs torch and triton, not importable here)"
    kinds: dict[str, int] = {}
    for g in groups:
        kinds[g["kind"]] = kinds.get(g["kind"], 0) + 1
    fused = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()) if kind != "region") or "no fused ops"
    note = f"{regions} generated region kernel(s) chosen by {how}; device passes: {fused}."
    return {"groups": groups, "note": note, "pass_regions": len(program.regions)}


def region_of(groups: list[dict[str, Any]]) -> dict[int, int]:
    return {i: k for k, g in enumerate(groups) for i in g["nodes"]}
