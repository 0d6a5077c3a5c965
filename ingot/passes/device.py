"""Each backend's device pipeline: the fusion passes that run after the generic ones, as rewrites into
FUSED ops (ops/fused.py) the backend lowers as one kernel each. A fusion is named by its pass without
"fuse_"; CompileOptions.fusions chooses among FUSIONS[device]. The compiler runs them after the generic
passes (compiler.run_pipeline); ingot.load runs them on a package compiled for another device.
"""
from __future__ import annotations

from typing import Callable

from ..errors import IngotError
from ..ir import Program
from .block_channels import block_channels
from .fuse_add_rms_norm import fuse_add_rms_norm
from .fuse_attention_gemv import fuse_attention_gemv
from .fuse_conv_epilogue import fuse_conv_epilogue
from .fuse_dynamic_quantize import fuse_dynamic_quantize
from .fuse_expand_depthwise import fuse_expand_depthwise
from .fuse_gathered_lora import fuse_gathered_lora
from .fuse_glu import fuse_glu
from .fuse_integer_matmul import fuse_integer_matmul
from .fuse_mel import fuse_mel
from .fuse_norm_gemv import fuse_norm_gemv
from .fuse_rope_cache import fuse_rope_cache
from .fuse_rows_attention import fuse_rows_attention
from .fuse_siblings import fuse_siblings
from .fuse_spatial import fuse_spatial
from .fuse_squeeze_excite import fuse_squeeze_excite
from .fuse_two_level import fuse_two_level
from .gemv_rules import SELF_XQ_BYTES, WORDS_MAX_ROWS

Pass = Callable[[Program], tuple[Program, bool]]
# Order matters: later fusions take earlier ones whole.
DevicePass = Callable[[Program, dict], tuple[Program, bool]]
DEVICE_PIPELINES: dict[str, list[tuple[str, DevicePass]]] = {
    "cpu": [
        # the :k formats' parameters as stored (codes x units): the GEMV multiplies them as it reads
        ("fuse_two_level", lambda p, o: fuse_two_level(p)),
        # max pool, nearest upsampling, depth-to-space: one step each (backends/cpu/spatial.py)
        ("fuse_spatial", lambda p, o: fuse_spatial(p)),
        ("fuse_conv_epilogue", lambda p, o: fuse_conv_epilogue(p)),   # activation, residual: per output tile
        ("fuse_squeeze_excite", lambda p, o: fuse_squeeze_excite(p)),   # pool, 2 tiny convs, scale: one step
        ("fuse_expand_depthwise", lambda p, o: fuse_expand_depthwise(p)),   # 1x1 -> depthwise: no NCHW between
        # chains of 1x1 and depthwise convs read and write blocks of 16 channels: no transposes between
        ("block_channels", lambda p, o: block_channels(p)),
        # rope(q), rope(k), the k/v cache writes and the attention: one step (backends/cpu/rope_cache.py)
        ("fuse_rope_cache", lambda p, o: fuse_rope_cache(p, attention=True, codes=True)),
        # ONNX's MatMulInteger sums on 8-bit x in int32 (backends/cpu/int8_matmul.py: VNNI)
        ("fuse_integer_matmul", lambda p, o: fuse_integer_matmul(p)),
        ("fuse_dynamic_quantize", lambda p, o: fuse_dynamic_quantize(p)),   # DynamicQuantizeLinear: one step
        # a rows decoder's (ingot serve) per-row attentions of a layer: one step over all rows
        ("fuse_rows_attention", lambda p, o: fuse_rows_attention(p)),
    ],
    "cuda": [
        # rope(q), rope(k) and the k/v cache writes as one kernel, or inside the decode attention
        ("fuse_rope_cache", lambda p, o: fuse_rope_cache(p, attention=o.get("rope_attention", True), codes=True)),
        # per-row adapters (ingot serve): shrink + expand kernels, x recomputed so the GEMV fusions below stay
        ("fuse_gathered_lora", lambda p, o: fuse_gathered_lora(p)),
        ("fuse_siblings", lambda p, o: fuse_siblings(p)),            # q/k/v, gate/up: one GEMV
        ("fuse_attention_gemv", lambda p, o: fuse_attention_gemv(p)),  # attention rounds x for the o GEMV
        ("fuse_glu", lambda p, o: fuse_glu(p, o["words_max_rows"])),   # silu(gate) * up in the down GEMV
        ("fuse_norm_gemv", lambda p, o: fuse_norm_gemv(p, o["words_max_rows"], o["self_xq_bytes"])),  # norm in the GEMV
        ("fuse_add_rms_norm", lambda p, o: fuse_add_rms_norm(p)),     # the rest: add + rms_norm, one kernel
        ("fuse_mel", lambda p, o: fuse_mel(p, o["mel_epilogue"])),     # STFT power -> mel (-> dB): one kernel
    ],
}
# every name options.fusions may hold: the passes, and choices the backend makes as it lowers
# (rope_attention: the RoPE/KV kernel inside the decode attention; regions: elementwise kernels;
# mel_epilogue: fuse_mel takes the dB scale after the mel too)
FUSIONS = {"cpu": tuple(name.removeprefix("fuse_") for name, _ in DEVICE_PIPELINES["cpu"]),
           "cuda": tuple(name.removeprefix("fuse_") for name, _ in DEVICE_PIPELINES["cuda"]) +
           ("rope_attention", "regions", "mel_epilogue")}


def device_steps(device: str, options=None) -> list[tuple[str, Pass]]:
    """The device pipeline's passes that `options` keep (all of them by default)."""
    fusions = getattr(options, "fusions", None)
    known = FUSIONS.get(device, ())
    if fusions is not None:
        unknown = set(fusions) - set(known)
        if unknown:
            raise IngotError(f"compile: fusions {sorted(unknown)} are not {device} fusions (those are {', '.join(known)}).")
    chosen = set(known) if fusions is None else set(fusions)
    tuning = getattr(options, "cuda", None)
    settings = {"rope_attention": "rope_attention" in chosen, "mel_epilogue": "mel_epilogue" in chosen,
                "words_max_rows": getattr(tuning, "gemv_rows", WORDS_MAX_ROWS),
                "self_xq_bytes": getattr(tuning, "self_xq_bytes", SELF_XQ_BYTES)}
    if getattr(tuning, "words_layout", True) is False:   # no word GEMV: nothing to fold into it
        chosen -= {"glu", "norm_gemv"}
    return [(name, lambda p, fn=fn: fn(p, settings)) for name, fn in DEVICE_PIPELINES.get(device, [])
            if name.removeprefix("fuse_") in chosen]
