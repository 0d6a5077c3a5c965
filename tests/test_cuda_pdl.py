"""Programmatic dependent launch (ingot/backends/cuda/pdl.py): a kernel may be scheduled before the
kernel ahead of it has finished, so every Triton kernel of the decode path must wait (`pdl_enter`)
before it loads or stores anything. Read from the kernels' source: runs wherever torch and triton
import (no GPU needed); CI, without them, skips it."""
from __future__ import annotations

import inspect
import re

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from ingot.backends.cuda import attention, fused, pdl, quantized_matmul  # noqa: E402

# what triton.jit returns: a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

JIT_TYPES = (triton.runtime.jit.JITFunction, InterpretedFunction)
MEMORY = re.compile(r"tl\.(load|store|atomic_\w+)\(|_load\w*\(|_row_rms\(|_row_dot\(|_block_params\(|_weight_tile\(")


def kernels():
    """The JIT kernels of the modules on the decode path: what reads tl.program_id and is defined in the
    module (or its package). Not helpers: those read no program id, or come from another module
    (gemm.gathered_codes, which the gather kernels call after their wait)."""
    for module in (attention, fused, quantized_matmul):
        for name, fn in vars(module).items():
            if isinstance(fn, JIT_TYPES) and fn.fn.__module__.startswith(module.__name__) and \
                    "tl.program_id" in inspect.getsource(fn.fn):
                yield f"{module.__name__.rsplit('.', 1)[-1]}.{name}", fn


EARLY_ENTER = "    if not EARLY:\n        pdl_enter(PDL)\n"   # the decode kernel's wait, unless EARLY moves it


def body_before_wait(source: str) -> str:
    """The code of a kernel from the end of its signature (and docstring) to `pdl_enter(PDL)` (the first
    one: the decode kernel has two, the second under EARLY, `early_block`)."""
    assert source.count("pdl_enter(PDL)") == 1 or (source.count("pdl_enter(PDL)") == 2 and EARLY_ENTER in source), \
        "one pdl_enter(PDL), or two with EARLY"
    head = source.split("pdl_enter(PDL)")[0]
    signature_end = re.search(r"\)\s*(->[^:]*)?:\s*\n", head).end()
    code = head[signature_end:]
    return re.sub(r'"""(.|\n)*?"""', "", code, count=1)


KERNELS = dict(kernels())


def test_the_decode_path_kernels_are_found():
    names = set(KERNELS)
    assert {"attention._decode_kernel", "quantized_matmul._qgemv_words_kernel", "quantized_matmul._quantize_x_kernel",
            "fused._rope_qkv_kernel", "fused._rms_norm_kernel"} <= names, names


# the loads allowed ahead of the wait: the word GEMV's first weight tiles under EARLY_W (constant weights
# of a captured graph, which no kernel of the stream writes)
EARLY_W_BLOCK = re.compile(r"    if PREFETCH and EARLY_W:[^\n]*\n(        [^\n]*\n)+")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_waits_before_it_touches_memory(name):
    fn = KERNELS[name]
    assert "PDL" in fn.arg_names, f"{name} takes no PDL constexpr: pdl_args(device) cannot switch it on"
    before = EARLY_W_BLOCK.sub("", body_before_wait(inspect.getsource(fn.fn)))
    assert not MEMORY.search(before), f"{name} touches memory before pdl_enter: {MEMORY.search(before).group(0)}"


def test_the_early_weight_load_reads_only_the_weight():
    before = body_before_wait(inspect.getsource(quantized_matmul._qgemv_words_kernel.fn))
    early = EARLY_W_BLOCK.search(before)
    assert early, "the word GEMV's EARLY_W block is gone: drop this test and the allowance"
    loads = re.findall(r"(tl\.load|_\w+)\((\w+)", early.group(0))
    assert loads == [("_weight_tile", "qw_ptr")], early.group(0)
    assert "store" not in early.group(0) and "atomic" not in early.group(0)


def early_block(source: str) -> str:
    """The decode kernel's code between `if not EARLY: pdl_enter(PDL)` and `if EARLY: pdl_enter(PDL)`."""
    after = source.split(EARLY_ENTER, 1)[1]
    assert "    if EARLY:" in after
    return after.split("    if EARLY:", 1)[0]


def test_the_early_decode_reads_only_the_length_position_caches_and_table():
    """Under EARLY the decode kernel reads, before its wait, what the caller promises the kernel ahead
    does not write: the length and position scalars, the caches' first key tile (FRESH: without the
    position's row, which this launch writes) and the RoPE table; it stores nothing."""
    early = early_block(inspect.getsource(attention._decode_kernel.fn))
    reads = re.findall(r"(tl\.load|_\w+)\((\w+)", early)
    assert {r for r in reads if r[0] == "tl.load"} == {("tl.load", "len_ptr"), ("tl.load", "pos_ptr"),
                                                       ("tl.load", "k_base"), ("tl.load", "v_base")}, reads
    assert ("_rotation", "pos") in reads and "store" not in early and "atomic" not in early and "q_ptr" not in early
    assert "n0_offs != skip" in early   # the position's row is left out of the early tile


def test_generated_region_kernels_wait_too():
    source_line = inspect.getsource(fused.RegionKernel.__init__)
    assert '"    pdl_enter(PDL)",' in source_line and "PDL: tl.constexpr = False" in source_line


def test_pdl_args_only_for_cuda_devices(monkeypatch):
    torch = pytest.importorskip("torch")
    assert pdl.pdl_args(torch.device("cpu")) == {}
    monkeypatch.setattr(pdl, "_CAPABLE", {0: True})
    assert pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_CAPABLE", {0: False})   # before sm_90
    assert pdl.pdl_args(torch.device("cuda", 0)) == {}
