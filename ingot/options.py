"""Compile options: every choice a compile makes that is not in the graph, in one frozen object.

    >>> import ingot
    >>> opts = ingot.CompileOptions(cuda=ingot.options.CudaOptions.for_device("NVIDIA H200", gemv_limbs=3))
    >>> opts.cuda.gemv_limbs, opts.cuda.words_max_rows
    (3, 16)
    >>> ingot.CompileOptions.from_json(opts.to_json()) == opts
    True

`g.compile(..., options=)` takes them (the default: `CompileOptions.from_environment()`, the file
INGOT_OPTIONS names, else the defaults), `exe.options` holds them, and a saved package stores them
(`Executable.save`). CUDA tuning numbers come from a table keyed by the device's name
(`torch.cuda.get_device_name()`); a GPU not in the table gets the H200's, which are the dataclass
defaults. Each number says what it is and, where it was measured, what it won against; the losing
variants are gone from the kernels (git keeps them).

The environment variables Ingot reads (docs/cuda.md): INGOT_CUDA_DEVICE (the torch device "cuda"
means), INGOT_CACHE (the directory of generated kernels), INGOT_CPU_THREADS (`CpuOptions.threads`
when None) and INGOT_OPTIONS (a JSON file of CompileOptions); `read_env` is the one place the last
three are read.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import IngotError


@dataclass(frozen=True)
class CudaOptions:
    """Tuning numbers and choices of the CUDA kernels (defaults: measured on the H200)."""

    # -- quantized matmul (backends/cuda/quantized_matmul) -----------------------------------------
    words_layout: bool = True         # 4-bit matmul weights in the dp4a GEMV's word layout (prepare_weight)
    words_max_rows: int = 16          # rows of x up to which the word GEMV runs; more: the tensor-core GEMM
    words_bf16_max_rows: int = 8      # ... where prefill_precision is "bf16"; more: the word GEMM's bf16 dots
                                      # (H200, `ingot serve` Llama-3-8B int4: 16 streams 2,178 tok/s against
                                      # 1,499 with the GEMV; 8 streams 1,145 against 1,218)
    gemv_waves: int = 0               # warps a multiprocessor the word GEMV's split-K aims at; 0: one wave
                                      # from the kernel's registers (Llama-3-8B gate+up 23.7 us vs 24.7 at 32)
    gemv_tile_blocks: int = 0         # blocks of 32 k per word-GEMV tile: 1, 2, or 0 (1 where the GEMV is
                                      # latency-bound, else 2: SmolLM2 step 840 us vs 925 with 2 everywhere)
    gemv_limbs: int = 2               # bytes per rounded x: 1 (8 bits), 2 (16), 3 (22, float32-level)
    xq_min_bytes: int = 0             # weights from this size take x quantized by its own launch
    xq_blocks: int = 4                # blocks of 32 k per program of the quantize launch
    xq_norm_block: int = 4096         # floats of a row per step of the quantize launch's sum of squares
    xq_norm_warps: int = 8            # the quantize launch's warps with a whole-row norm
    xq_norm_parts_min_k: int = 1024   # from this K the norm's sum of squares is taken by parts (XQ_RMS)
    self_xq_bytes: int = 4 << 20      # word GEMVs of smaller weights round their own x (no quantize launch)
    attention_xq_bytes: int = 256 << 20   # the decode attention rounds its output for o GEMVs below this
    # -- attention (backends/cuda/attention) -------------------------------------------------------
    decode_merge_max_splits: int = 32     # the last split merges (no combine launch) up to this many splits
    decode_merge_splits: int = 8          # the most splits launched a KV head where they merge in the kernel
    decode_precision: str = "tf32x3p"     # float32 decode dots: "tf32x3p", "tf32x3", "ieee" (the first
                                          # measured fastest at float32-level accuracy); "bf16": q, p and
                                          # the cache rounded to bfloat16, one product (bf16 activations)
    decode_chunk_kb: int = 32             # K+V kilobytes a short cache's split reads at least
    decode_block_n: int = 0               # keys a tile (0: 64, 32 past head dim 128)
    decode_chunk_align: int = 0           # a split's keys a multiple of this (0: the key tile)
    decode_fresh_tile_bytes: int = 32 << 10   # the new key/value from registers where a K+V tile fits this
    decode_warps: int = 0                 # the decode kernel's warps (0: 8 with RoPE past fresh tiles, else 4)
    prefill_precision: str = "tf32x3"     # the prefill's float32 GEMM and attention dots: "tf32x3" (float32-level
                                          # accuracy), "bf16" (operands rounded to bfloat16, float32 sums) or
                                          # "f16" (to float16: 8x closer at the same speed; the GEMMs scale x's
                                          # rows by powers of two against overflow, quantized_matmul/half_rows.py)
    prefill_dequant_rows: int = 64        # from this many rows of x the prefill GEMM multiplies a dequantized copy of
                                          # W with cuBLAS (0: never; else the tensor-core kernel dequantizes tile by
                                          # tile, K split up to 128 rows). H100, Llama-3-8B shapes (cuda-prefill
                                          # --gemm): 32 rows, the kernel 21-24 TFLOP/s (tf32x3) / 35-43 (bf16)
                                          # against the copy's 13-18 / 27-35; 64 rows 17-20 / 62-78 against
                                          # 24-28 / 39-72; 128 rows 14-20 / 61-84 against 34-38 / 103-139
    prefill_hopper: str = "auto"          # the Hopper prefill kernel (flash_sm90): "auto", "always", "never"
    prefill_hopper_min_rows: int = 2048   # "auto": from this many query rows at head dim 128
    # -- float models (convolutions and matmuls through cuDNN and cuBLAS: ONNX models) -------------
    float32_precision: str = "ieee"   # their float32 products: "ieee" (exact) or "tf32" (tensor cores, operands
                                      # rounded to 10-bit mantissas: torch eager's default for convolutions)
    # -- audio (backends/cuda/fft) ----------------------------------------------------------------
    mel_block_frames: int = 128       # frames per program of the generated mel kernel
    mel_warps: int = 4                # its warps
    mel_lookahead: int = 16           # bins loaded ahead of their use (1.375 ms the hour vs 1.428 with 1)
    mel_pass_frames: int = 1 << 17    # frames per cuFFT batch once chunks are merged
    mel_streams: int = 2              # streams the passes alternate over
    # -- the runtime ------------------------------------------------------------------------------
    graphs: bool = True               # decode steps captured and replayed as CUDA graphs
    timeline: str = "off"             # a diagnostic (timeline.py): "off", "end" or "all" points stamped

    @property
    def gemv_rows(self) -> int:
        """Rows of x up to which the word GEMV (and the fusions into it) runs: words_max_rows, or with
        16-bit many-row dots (prefill_precision "bf16" or "f16") at most words_bf16_max_rows."""
        if self.prefill_precision in ("bf16", "f16"):
            return min(self.words_max_rows, self.words_bf16_max_rows)
        return self.words_max_rows

    def __post_init__(self) -> None:
        _check_fields(self, "cuda")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise IngotError(f"options: cuda.{name} is {getattr(self, name)!r}; one of {', '.join(map(repr, allowed))}.")
        if self.gemv_limbs not in (1, 2, 3):
            raise IngotError(f"options: cuda.gemv_limbs is {self.gemv_limbs}; x is rounded to 1, 2 or 3 bytes.")
        if self.gemv_tile_blocks not in (0, 1, 2):
            raise IngotError(f"options: cuda.gemv_tile_blocks is {self.gemv_tile_blocks}; 0 (auto), 1 or 2.")
        for name in ("words_max_rows", "words_bf16_max_rows", "xq_blocks", "xq_norm_block", "xq_norm_warps", "decode_merge_splits",
                     "decode_chunk_kb", "mel_block_frames", "mel_warps", "mel_pass_frames"):
            if getattr(self, name) < 1:
                raise IngotError(f"options: cuda.{name} is {getattr(self, name)}; it must be at least 1.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise IngotError(f"options: cuda.{f.name} is {value}; it must not be negative.")

    @classmethod
    def for_device(cls, name: str | None, **overrides: Any) -> CudaOptions:
        """The tuning of the GPU called `name` (`torch.cuda.get_device_name()`; unknown: the H200's),
        with `overrides` on top.

            >>> CudaOptions.for_device("NVIDIA H200", decode_warps=8).decode_warps
            8
        """
        unknown = set(overrides) - _names(cls)
        if unknown:
            raise IngotError(f"options: CudaOptions has no field {sorted(unknown)[0]!r}.")
        return cls(**{**DEVICE_TUNING.get(name or "", {}), **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "cuda") -> CudaOptions:
        return cls(**_fields_of(cls, data, where))


# The tuning that differs from the defaults, per device name. The defaults are the H200's
# (measured there, BENCHMARKS.md); a device measured otherwise gets an entry of what differs.
DEVICE_TUNING: dict[str, dict[str, Any]] = {
    "NVIDIA H200": {},
}

_CHOICES = {"decode_precision": ("tf32x3p", "tf32x3", "ieee", "bf16"), "prefill_precision": ("tf32x3", "bf16", "f16"),
            "float32_precision": ("ieee", "tf32"),
            "prefill_hopper": ("auto", "always", "never"),
            "timeline": ("off", "end", "all")}


@dataclass(frozen=True)
class CpuOptions:
    """Choices of the CPU backend."""

    threads: int | None = None   # the CPU threads: the quantized GEMV's pool, BLAS (prefill) and the convs'
                                 # output channels (backends/cpu/conv.py threaded_step);
                                 # None: INGOT_CPU_THREADS, else the cores this process may run on
    gemv_activations: str = "float32"   # "int8": the quantized GEMV rounds x to int8 per block of 32 k
                                        # and multiplies in integers, as llama.cpp does (BENCHMARKS.md:
                                        # speed and accuracy); "float32": exact float products
    float32_precision: str = "bf16x3"   # float32 convolutions and matmuls by constant weights on hosts
                                        # with AMX (backends/cpu/conv_amx.py): "bf16x3" each product as
                                        # three bfloat16 ones on the tiles (~5e-6 of a layer's largest
                                        # output, float32's own summation error at K ~ 2k); "bf16x6"
                                        # float32's rounding at twice the tiles' work; "float32" the
                                        # AVX-512 kernels and BLAS. Hosts without AMX always use the last.
    winograd_channels: int = 16   # 3x3 stride-1 pad-1 float32 convs with at least this many input and
                                  # output channels run as Winograd F(2x2, 3x3) (backends/cpu/
                                  # conv_winograd.py: 16 products for the direct kernel's 36, ~1e-7
                                  # relative more rounding); 0: never

    def __post_init__(self) -> None:
        _check_fields(self, "cpu")
        if self.threads is not None and self.threads < 1:
            raise IngotError(f"options: cpu.threads is {self.threads}; at least 1 (or None).")
        if self.gemv_activations not in ("float32", "int8"):
            raise IngotError(f"options: cpu.gemv_activations is {self.gemv_activations!r}; 'float32' or 'int8'.")
        if self.winograd_channels < 0:
            raise IngotError(f"options: cpu.winograd_channels is {self.winograd_channels}; 0 (never) or more.")
        if self.float32_precision not in ("bf16x3", "bf16x6", "float32"):
            raise IngotError(f"options: cpu.float32_precision is {self.float32_precision!r}; 'bf16x3', 'bf16x6' or "
                             "'float32'.")

    @property
    def resolved_threads(self) -> int:
        """`threads`, or INGOT_CPU_THREADS, or the cores this process may run on."""
        if self.threads is not None:
            return self.threads
        text = read_env("INGOT_CPU_THREADS")
        try:
            return max(1, int(text)) if text else usable_cores()
        except ValueError:
            raise IngotError(f"INGOT_CPU_THREADS is {text!r}, not a number of threads.") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "cpu") -> CpuOptions:
        return cls(**_fields_of(cls, data, where))


@dataclass(frozen=True)
class CompileOptions:
    """What `Graph.compile(..., options=)` takes.

    fusions: the device fusions to run, by name (None: every fusion the device pipeline has; the
    compiler names them and checks the names). cuda / cpu: the backends' options.
    """

    fusions: frozenset[str] | None = None
    cuda: CudaOptions = field(default_factory=CudaOptions)
    cpu: CpuOptions = field(default_factory=CpuOptions)

    def __post_init__(self) -> None:
        if self.fusions is not None:
            if isinstance(self.fusions, str) or not all(isinstance(f, str) for f in self.fusions):
                raise IngotError(f"options: fusions is {self.fusions!r}; a set of fusion names, or None for all.")
            object.__setattr__(self, "fusions", frozenset(self.fusions))
        if not isinstance(self.cuda, CudaOptions):
            raise IngotError(f"options: cuda is a {type(self.cuda).__name__}, not CudaOptions.")
        if not isinstance(self.cpu, CpuOptions):
            raise IngotError(f"options: cpu is a {type(self.cpu).__name__}, not CpuOptions.")

    def to_dict(self) -> dict:
        return {"fusions": sorted(self.fusions) if self.fusions is not None else None,
                "cuda": self.cuda.to_dict(), "cpu": self.cpu.to_dict()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Any) -> CompileOptions:
        """Options from their `to_dict` form; keys left out keep their defaults, unknown keys or values
        of the wrong type raise an IngotError naming the field."""
        if not isinstance(data, dict):
            raise IngotError(f"options: expected an object of options, got {type(data).__name__}.")
        unknown = set(data) - {"fusions", "cuda", "cpu"}
        if unknown:
            raise IngotError(f"options: unknown field {sorted(unknown)[0]!r} (fields: fusions, cuda, cpu).")
        fusions = data.get("fusions")
        if fusions is not None and (not isinstance(fusions, list) or not all(isinstance(f, str) for f in fusions)):
            raise IngotError(f"options: fusions is {fusions!r}; a list of fusion names, or null for all.")
        return cls(frozenset(fusions) if fusions is not None else None, CudaOptions.from_dict(data.get("cuda", {})),
                   CpuOptions.from_dict(data.get("cpu", {})))

    @classmethod
    def from_json(cls, text: str) -> CompileOptions:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise IngotError(f"options: not valid JSON ({e}).") from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> CompileOptions:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise IngotError(f"options: cannot read {path}: {e.strerror or e}.") from None
        try:
            return cls.from_json(text)
        except IngotError as e:
            raise IngotError(f"{path}: {e}") from None

    @classmethod
    def from_command_line(cls, gemv_activations: str | None = None, prefill_precision: str | None = None,
                          threads: int | None = None) -> CompileOptions:
        """The options `ingot generate/chat/serve/eval` compile with: INGOT_OPTIONS's (else the defaults), with
        the flags given on top: `--gemv-activations` ("float32": exact float products, the default; "int8":
        x rounded to int8 per block of 32 as llama.cpp does, faster, BENCHMARKS.md), `--prefill-precision`
        (CUDA: "tf32x3", float32-level, the default; "bf16"; "f16") and `--threads` (the CPU threads)."""
        options = cls.from_environment()
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
                raise IngotError(f"--threads must be in 1..1024, not {threads}.")
            options = dataclasses.replace(options, cpu=dataclasses.replace(options.cpu, threads=threads))
        if gemv_activations is not None:
            if gemv_activations not in ("float32", "int8"):
                raise IngotError(f"--gemv-activations is {gemv_activations!r}; 'float32' or 'int8'.")
            options = dataclasses.replace(options, cpu=dataclasses.replace(options.cpu, gemv_activations=gemv_activations))
        if prefill_precision is not None:
            if prefill_precision not in _CHOICES["prefill_precision"]:
                raise IngotError(f"--prefill-precision is {prefill_precision!r}; 'tf32x3', 'bf16' or 'f16'.")
            options = dataclasses.replace(options, cuda=dataclasses.replace(options.cuda, prefill_precision=prefill_precision))
        return options

    @classmethod
    def from_environment(cls) -> CompileOptions:
        """The options in the JSON file INGOT_OPTIONS names, else the defaults."""
        path = read_env("INGOT_OPTIONS")
        return cls.from_file(path) if path else cls()


ENV_VARIABLES = ("INGOT_CUDA_DEVICE", "INGOT_CACHE", "INGOT_CPU_THREADS", "INGOT_OPTIONS")


def read_env(name: str) -> str | None:
    """One of ENV_VARIABLES from the environment (None or "" when unset)."""
    assert name in ENV_VARIABLES, name
    return os.environ.get(name)


def cache_dir() -> str:
    """The root directory of Ingot's generated files: INGOT_CACHE, else ~/.cache/ingot."""
    return read_env("INGOT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ingot")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _fields_of(cls, data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise IngotError(f"options: {where} is {data!r}, not an object of options.")
    unknown = set(data) - _names(cls)
    if unknown:
        raise IngotError(f"options: unknown field {where}.{sorted(unknown)[0]}.")
    return dict(data)


_TYPES = {"bool": (bool,), "int": (int,), "str": (str,), "int | None": (int, type(None))}


def _check_fields(obj, where: str) -> None:
    """Every field of the dataclass `obj` of its annotated type (bool is not an int here, nor an int a bool)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kinds = _TYPES[f.type]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise IngotError(f"options: {where}.{f.name} is {value!r} ({type(value).__name__}); expected {f.type}.")


DEFAULT_CUDA = CudaOptions()
DEFAULT_CPU = CpuOptions()

__all__ = ["CompileOptions", "CudaOptions", "CpuOptions", "DEVICE_TUNING", "cache_dir", "read_env"]
