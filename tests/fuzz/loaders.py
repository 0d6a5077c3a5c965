"""One fuzz harness per loader: its seeds (real and tiny generated inputs), how a case is made from
them, and the target that runs a case in the forked child (tests/fuzz/harness.py).

    LOADERS["gguf"].case(draw)      -> a case (bytes, a dict of files, a string): small and printable
    LOADERS["gguf"].target(case)    runs it: writes it into a scratch folder and loads it as Ingot would

A target returns normally (the input was accepted) or raises IngotError (refused); anything else is
a bug. Seeds are built once in the parent, before any fork.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .mutate import INTERESTING_FLOATS, Draw, hostile_value, mutate_bytes, mutate_json

HERE = Path(__file__).resolve().parent
SCRATCH = Path(tempfile.gettempdir()) / f"ingot-fuzz-{os.getpid()}"   # everything a run writes; removed at exit
_OWNER = os.getpid()


@atexit.register
def _remove_scratch() -> None:
    if os.getpid() == _OWNER:   # (children leave by os._exit: this runs in the parent only)
        shutil.rmtree(SCRATCH, ignore_errors=True)


def temporary_folder(prefix: str) -> Path:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=SCRATCH))


def _hostile():
    import sys
    tests = str(HERE.parent)
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import hostile
    return hostile


def scratch() -> Path:
    """A fresh folder for one case (in the child: named after its pid)."""
    folder = SCRATCH / str(os.getpid())
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


@dataclass
class Loader:
    name: str
    case: Callable[[Draw], Any]
    target: Callable[[Any], None]
    seeds: Callable[[], Any]        # built once, in the parent
    warm: bool = True               # run the target on the seeds in the parent first (imports, JIT)

    def run(self, case: Any) -> None:
        """The target, then its scratch folder removed (in the child; a killed child's is removed at exit)."""
        try:
            self.target(case)
        finally:
            shutil.rmtree(SCRATCH / str(os.getpid()), ignore_errors=True)

    def prepare(self) -> None:
        """Build the seeds and, once in this process, do what every case does (imports, kernels
        compiled): each forked child then starts warm."""
        seeds = self.seeds()
        if not self.warm:
            return
        if self.name == "gguf":
            cases = [data for data, _ in seeds[:2]]
            _gguf_tensor_headers(0), _gguf_tensor_headers(1)
        elif self.name == "audio":
            cases = [(data, rate) for data in seeds for rate in (None, 16000)]  # (resampling imports scipy)
        elif self.name == "onnx":
            cases = [{"model.onnx": data} for data in seeds]
        else:
            cases = list(seeds)
        for case in cases:
            self.target(case)


# -- GGUF -----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def gguf_seeds() -> list[tuple[bytes, int]]:
    """(file bytes, header length) for a tiny F32 Llama, a tiny quantized one with an odd vocabulary,
    and the default model's header region (its metadata and tensor list, no tensor data)."""
    import gguf
    h = _hostile()
    folder = temporary_folder("seeds-")
    T = gguf.GGMLQuantizationType
    paths = [h.tiny_llama_gguf(folder / "f32.gguf"),
             h.tiny_llama_gguf(folder / "q.gguf", vocab=271, quantize={"token_embd.weight": T.Q4_0,
                                                                       "blk.0.attn_q.weight": T.Q8_0,
                                                                       "blk.0.ffn_down.weight": T.Q4_1})]
    seeds = []
    for p in paths:
        seeds.append((Path(p).read_bytes(), int(gguf.GGUFReader(p).data_offset)))
    try:
        from ingot.llm.generate import default_model_path
        real = default_model_path()
        head = int(gguf.GGUFReader(real).data_offset)
        with open(real, "rb") as f:
            seeds.append((f.read(head), head))
    except Exception:  # the default model is not installed: the tiny seeds only
        pass
    return seeds


GGUF_KEYS = ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
             "llama.attention.head_count_kv", "llama.feed_forward_length", "llama.context_length",
             "llama.rope.dimension_count", "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
             "llama.attention.key_length", "llama.rope.scaling.type", "llama.rope.scaling.factor",
             "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
             "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
             "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
             "tokenizer.ggml.scores"]


def _gguf_writable(value: Any) -> Any:
    """A hostile value in a form gguf.GGUFWriter can store (None: delete the key)."""
    if isinstance(value, dict):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return max(min(value, 2**64 - 1), -2**63)
    if isinstance(value, list):
        flat = [v for v in value if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
        if flat and isinstance(flat[0], str):
            return [str(v) for v in flat]
        return [max(min(int(v), 2**31 - 1), -2**31) if isinstance(v, int) else v for v in flat if not isinstance(v, str)]
    return value


@functools.lru_cache(maxsize=None)
def _gguf_tensor_headers(seed: int) -> dict[str, tuple[int, int]]:
    """{tensor name: (offset of its n_dims field, n_dims)} in gguf_seeds()[seed], parsed once."""
    import gguf
    h = _hostile()
    path = temporary_folder("seeds-") / "m.gguf"
    path.write_bytes(gguf_seeds()[seed][0])
    return {t.name: h.gguf_tensor_header(path, t.name) for t in gguf.GGUFReader(str(path)).tensors}


def gguf_case(draw: Draw) -> bytes:
    h = _hostile()
    seeds = gguf_seeds()
    kind = draw.integer(0, 9)
    if kind < 4:                                 # bytes, mostly in the header of any seed
        data, head = draw.choice(seeds)
        return mutate_bytes(draw, data, focus=head, rounds=6)
    if kind >= 8:                                # the tensor list of a tiny model
        seed = draw.integer(0, 1)
        buf = bytearray(seeds[seed][0])
        headers = _gguf_tensor_headers(seed)
        name = draw.choice(list(headers))
        at, n_dims = headers[name]
        what = draw.integer(0, 2)                # (as hostile.patch_gguf_tensor, on offsets parsed once)
        if what == 0:
            struct.pack_into(f"<{n_dims}Q", buf, at + 4, *[draw.interesting_int() % 2**64 for _ in range(n_dims)])
        elif what == 1:
            struct.pack_into("<I", buf, at + 4 + 8 * n_dims, draw.choice([draw.integer(0, 40), 2**32 - 1, 9999]))
        else:
            struct.pack_into("<Q", buf, at + 8 + 8 * n_dims, draw.interesting_int() % 2**64)
        return bytes(buf)
    metadata = {}                                # metadata values of the tiny model
    for _ in range(draw.integer(1, 3)):
        key = draw.choice(GGUF_KEYS)
        if key == "tokenizer.ggml.tokens" and draw.chance(2):
            metadata[key] = h.tokenizer_metadata()["tokenizer.ggml.tokens"][: draw.integer(0, 300)]
        elif key == "tokenizer.ggml.merges" and draw.chance(2):
            metadata[key] = [draw.choice(["h e", "zz qq", "", "a", "he ll o", "\u0120 t"]) for _ in range(3)]
        else:
            metadata[key] = _gguf_writable(hostile_value(draw))
    drop = tuple(draw.choice(list(h.llama_tensors())) for _ in range(draw.integer(0, 1)))
    folder = temporary_folder("case-")
    try:
        try:
            path = h.tiny_llama_gguf(folder / "m.gguf", metadata=metadata, drop=drop)
        except (TypeError, ValueError, OverflowError, struct.error):  # the writer cannot store that value
            path = h.tiny_llama_gguf(folder / "m.gguf")
        return Path(path).read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def gguf_target(data: bytes) -> None:
    from ingot.importers.gguf import read_gguf
    from ingot.llm.tokenizer import Tokenizer
    from ingot.models import llama

    path = scratch() / "m.gguf"
    path.write_bytes(data)
    model = read_gguf(path)                                   # every tensor converted
    if model.architecture not in llama.ARCHITECTURES:
        return
    config = llama.LlamaConfig.from_gguf(model)
    tokenizer = Tokenizer(model.metadata)
    tokenizer.decode(tokenizer.encode("hello world"))
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    config.context_length = min(config.context_length, 64)   # as LLM caps it by its context argument
    llama.build(config, model.tensors, str(path))


# -- ONNX -----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def onnx_seeds() -> list[bytes]:
    from onnx import TensorProto, helper, numpy_helper
    h = _hostile()
    f32 = lambda name, a: numpy_helper.from_array(np.asarray(a, np.float32), name)  # noqa: E731
    i64 = lambda name, a: numpy_helper.from_array(np.asarray(a, np.int64), name)  # noqa: E731
    vi = helper.make_tensor_value_info
    rng = np.random.default_rng(0)
    mlp = h.onnx_model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["a"]),
         helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["z"]),
         helper.make_node("Softmax", ["z"], ["y"], axis=-1)],
        [vi("x", TensorProto.FLOAT, [2, 8])], [vi("y", TensorProto.FLOAT, [2, 4])],
        [f32("w1", rng.standard_normal((8, 16))), f32("b1", np.zeros(16)), f32("w2", rng.standard_normal((16, 4)))])
    shapes = h.onnx_model(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
         helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
         helper.make_node("ConstantOfShape", ["s"], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
         helper.make_node("Add", ["x", "c"], ["xc"]), helper.make_node("Concat", ["n", "n"], ["nn"], axis=0),
         helper.make_node("Reshape", ["xc", "shape"], ["y"]), helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
         helper.make_node("OneHot", ["idx", "depth", "values"], ["oh"], axis=-1),
         helper.make_node("CumSum", ["rf", "axis"], ["cs"])],
        [vi("x", TensorProto.FLOAT, [3, 4])],
        [vi("y", TensorProto.FLOAT, None), vi("cs", TensorProto.FLOAT, None), vi("oh", TensorProto.FLOAT, None)],
        [i64("zero", [0]), i64("start", 0), i64("limit", 5), i64("delta", 1), i64("shape", [4, 3]),
         i64("idx", [0, 2]), i64("depth", [3]), f32("values", [0, 1]), i64("axis", 0)])
    image = h.onnx_model(
        [helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),
         helper.make_node("Conv", ["p", "k"], ["c"], kernel_shape=[3, 3], strides=[1, 1]),
         helper.make_node("Resize", ["c", "", "scales"], ["r"], mode="linear"),
         helper.make_node("Transpose", ["r"], ["t"], perm=[0, 1, 3, 2]),
         helper.make_node("ReduceMean", ["t", "axes"], ["y"], keepdims=1)],
        [vi("x", TensorProto.FLOAT, [1, 1, 6, 6])], [vi("y", TensorProto.FLOAT, None)],
        [i64("pads", [0, 0, 1, 1, 0, 0, 1, 1]), f32("k", rng.standard_normal((2, 1, 3, 3))),
         f32("scales", [1, 1, 2, 2]), i64("axes", [2])])
    return [h.onnx_add_model().SerializeToString(), mlp.SerializeToString(), shapes.SerializeToString(),
            image.SerializeToString()]


def _raw_bytes(init) -> bytes:
    """An initializer's data as bytes (one made external by an earlier edit of this case: its first 4 bytes)."""
    import onnx
    if init.data_location == onnx.TensorProto.EXTERNAL:   # (onnx reads nothing of a location it has no folder for)
        return b"\0\0\x80?"
    return init.raw_data or np.asarray(onnx.numpy_helper.to_array(init)).tobytes()


def onnx_case(draw: Draw) -> dict:
    """{"model.onnx": bytes, other file names: bytes} (external data lives beside the model)."""
    import onnx
    data = draw.choice(onnx_seeds())
    if draw.chance(3):
        return {"model.onnx": mutate_bytes(draw, data, rounds=6)}
    model = onnx.ModelProto()
    model.ParseFromString(data)
    files: dict[str, bytes] = {}
    for _ in range(draw.integer(1, 3)):
        what = draw.integer(0, 6)
        g = model.graph
        if what == 0 and g.node:                         # an attribute's value
            node = draw.choice(list(g.node))
            if node.attribute:
                a = draw.choice(list(node.attribute))
                if a.ints:
                    a.ints[draw.integer(0, len(a.ints) - 1)] = max(min(draw.interesting_int(), 2**63 - 1), -2**63)
                elif a.type == a.INT:
                    a.i = max(min(draw.interesting_int(), 2**63 - 1), -2**63)
                elif a.type == a.FLOAT:
                    a.f = draw.choice(INTERESTING_FLOATS)
                elif a.type == a.STRING:
                    a.s = draw.choice([b"", b"nearest", b"cubic", b"x" * 300, b"\xff"])
        elif what == 1 and g.initializer:                # an initializer's dims, type or values
            init = draw.choice(list(g.initializer))
            choice = draw.integer(0, 2)
            if choice == 0 and init.dims:
                init.dims[draw.integer(0, len(init.dims) - 1)] = max(min(draw.interesting_int(), 2**63 - 1), -2**63)
            elif choice == 1:
                init.data_type = draw.integer(0, 30)
            else:
                raw = _raw_bytes(init)
                init.raw_data = mutate_bytes(draw, raw)
        elif what == 2 and g.input:                      # a declared input dimension
            dims = g.input[0].type.tensor_type.shape.dim
            if dims:
                d = dims[draw.integer(0, len(dims) - 1)]
                if draw.chance(3):
                    d.dim_param = "n"
                else:
                    d.dim_value = max(min(draw.interesting_int(), 2**63 - 1), -2**63)
        elif what == 3 and g.node:                       # another op in a node's place
            draw.choice(list(g.node)).op_type = draw.choice(
                ["Reshape", "Expand", "Tile", "Slice", "Gather", "Range", "ConstantOfShape", "Pad", "Resize", "OneHot",
                 "Split", "Concat", "Squeeze", "Unsqueeze", "Transpose", "TopK", "Einsum", "NoSuchOp"])
        elif what == 4 and g.initializer:                # external data, with hostile fields
            init = draw.choice(list(g.initializer))
            raw = _raw_bytes(init)
            init.ClearField("raw_data")
            for field in ("float_data", "int64_data", "int32_data", "double_data"):
                init.ClearField(field)
            init.data_location = onnx.TensorProto.EXTERNAL
            location = draw.choice(["w.bin", "../w.bin", "/etc/hostname", "sub/../w.bin", "link.bin", "w.bin\0",
                                    "a" * 300, ""])
            for key, value in (("location", location),
                               ("offset", draw.choice(["0", "4", "-1", "abc", str(2**64), ""])),
                               ("length", draw.choice([str(len(raw)), "0", "99999999", "x"]))):
                if not draw.chance(5):
                    e = init.external_data.add()
                    e.key, e.value = key, value
            files["w.bin"] = raw
            if draw.chance(2):
                files["@link.bin"] = b"../outside.bin"   # '@' marks a symlink to create
        elif what == 5 and g.node:                       # drop or rename a node input
            node = draw.choice(list(g.node))
            if node.input:
                node.input[draw.integer(0, len(node.input) - 1)] = draw.choice(["", "nope", node.output[0]])
        else:                                            # the opset
            model.opset_import[0].version = draw.choice([0, 1, 7, 11, 13, 17, 21, 99, -1])
    files["model.onnx"] = model.SerializeToString()
    return files


def _write_files(folder: Path, files: dict) -> None:
    for name, data in files.items():
        if name.startswith("@"):
            (folder / name[1:]).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(data.decode(), folder / name[1:])
        else:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)


def _zeros_for(exe) -> dict:
    return {name: np.zeros(t.shape, t.dtype.storage) for name, t in exe.feed_types.items()}


def onnx_target(files: dict) -> None:
    from ingot.importers.onnx import from_onnx
    folder = scratch()
    (folder.parent / "outside.bin").write_bytes(b"\x01" * 64)   # what a traversal would read
    model_folder = folder / "m"
    model_folder.mkdir()
    _write_files(model_folder, files)
    exe = from_onnx(str(model_folder / "model.onnx"))
    if hasattr(exe, "feed_types"):
        feeds = _zeros_for(exe)   # (inputs the compiled program no longer reads still take a value)
    else:                         # compiled at run, per input shape (symbolic dimensions) and shape-giving value
        feeds = _zeros_as_declared(exe.model.graph.input)
        if feeds is None:
            return
    exe.run({name: feeds.get(name, np.zeros((), np.float32)) for name in exe.onnx_inputs})


def _zeros_as_declared(inputs, symbolic: int = 2, limit: int = 1 << 24) -> dict | None:
    """Zeros of each graph input's declared shape and type (a symbolic dimension: `symbolic`); None when an
    input would hold more than `limit` elements (no caller could feed it: the import is judged alone)."""
    from onnx import helper
    feeds = {}
    for vi in inputs:
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else symbolic for d in t.shape.dim]
        if max(shape, default=0) > limit or int(np.prod(shape, dtype=object)) > limit:
            return None
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        except (KeyError, TypeError, ValueError):  # a type NumPy lacks: Ingot is to refuse it, fed float32
            dtype = np.dtype(np.float32)
        feeds[vi.name] = np.zeros(shape, dtype)
    return feeds


# -- packages -------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def package_seeds() -> list[dict]:
    """The files of a tiny package and of a tiny LLM package (int4 weights), by relative path."""
    from ingot.convert import convert
    h = _hostile()
    folder = temporary_folder("seeds-")
    small = h.tiny_package(folder / "p.ingot")
    convert(h.tiny_llama_gguf(folder / "t.gguf"), folder / "llm.ingot", quantize="int4:32")
    seeds = []
    for root in (small, folder / "llm.ingot"):
        seeds.append({str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()})
    return seeds


def package_case(draw: Draw) -> dict:
    files = dict(draw.choice(package_seeds()))
    for _ in range(draw.integer(1, 2)):
        name = draw.choice(sorted(files))
        data = files[name]
        try:
            if name.endswith(".json") and not draw.chance(4):
                files[name] = json.dumps(mutate_json(draw, json.loads(data)), allow_nan=True).encode()
                continue
            if name.endswith(".safetensors") and not draw.chance(3):
                (n,) = struct.unpack("<Q", data[:8])
                header = json.loads(data[8:8 + n])
                new = json.dumps(mutate_json(draw, header, rounds=2), allow_nan=True).encode()
                files[name] = struct.pack("<Q", len(new)) + new + data[8 + n:]
                continue
        except RecursionError:
            files[name] = b"[" * 100000
            continue
        except (ValueError, struct.error):  # mutated already in an earlier round: mutate its bytes instead
            pass
        files[name] = mutate_bytes(draw, data, focus=256)
    if draw.chance(10):
        files["@callables/x.ingot"] = b"../../.."
    return files


def package_target(files: dict) -> None:
    import ingot
    from ingot.llm.package import is_llm_package, read_llm
    folder = scratch() / "p.ingot"
    folder.mkdir()
    _write_files(folder, files)
    if is_llm_package(folder):
        read_llm(folder)
    exe = ingot.load(str(folder))
    exe.run(_zeros_for(exe))


# -- audio ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def audio_seeds() -> list[bytes]:
    import io

    import soundfile
    h = _hostile()
    t = np.arange(2000) / 8000.0
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    out = [h.wav_bytes(tone)]
    for fmt, subtype, channels in (("WAV", "FLOAT", 2), ("FLAC", "PCM_16", 1)):
        buf = io.BytesIO()
        soundfile.write(buf, np.stack([tone] * channels, axis=1), 8000, format=fmt, subtype=subtype)
        out.append(buf.getvalue())
    return out


def audio_case(draw: Draw) -> tuple[bytes, int | None]:
    data = mutate_bytes(draw, draw.choice(audio_seeds()), focus=64, rounds=5)
    return data, draw.choice([None, None, 16000, 22050])


def audio_target(case: tuple[bytes, int | None]) -> None:
    from ingot.audio_io import read_audio
    from ingot.models import audio
    data, rate = case
    path = scratch() / "a.wav"
    path.write_bytes(data)
    signal, sample_rate = read_audio(path, rate)
    if len(signal) <= 1 << 15:
        audio.evaluate(audio.log_mel_spectrogram, signal, sample_rate=sample_rate, n_fft=256, n_mels=20)


# -- chat templates -------------------------------------------------------------------------------------

FRAGMENTS = [
    "{% for i in range(99999) %}", "{% endfor %}", "{% for m in messages %}", "{{ m['content'] }}",
    "{{ 'a' * 2**31 }}", "{{ ('a'*10**6)|wordwrap(1) }}", "{{ messages|tojson }}", "{% if loop.first %}",
    "{% endif %}", "{% set ns = namespace(x='a') %}", "{% set ns.x = ns.x ~ ns.x %}", "{{ ns.x|length }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{ raise_exception('no') }}", "{{ ''.__class__ }}",
    "{{ range(10)|batch(3)|list }}", "{{ '%99999999d' % 1 }}", "{{ '{:>99999999}'.format(1) }}",
    "{{ strftime_now('%Y') }}", "{{ bos_token }}", "{{ 10**10**3 }}", "{{ [1]*10**7 }}", "{{ 'x'|center(10**8) }}",
    "{%", "}}", "{{", "%}", "{# ", " #}", "{% generation %}", "{% endgeneration %}", "{% break %}",
    "{{ dict(a=1).items()|list }}", "{{ messages[0].role.upper() }}", "{{ (messages * 100000)|length }}",
]


@functools.lru_cache(maxsize=None)
def template_seeds() -> list[str]:
    from ingot.llm.chat import CHATML_TEMPLATE
    seeds = [CHATML_TEMPLATE,
             "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
             "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
             "{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}{% set ns.sys = m.content %}"
             "{% endif %}{% endfor %}{{ ns.sys }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n"
             "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"]
    try:
        from ingot.importers.gguf import read_gguf
        from ingot.llm.generate import default_model_path
        real = read_gguf(default_model_path(), lazy=True).get("tokenizer.chat_template")
        if real:
            seeds.append(real)
    except Exception:
        pass
    return seeds


def template_case(draw: Draw) -> str:
    text = draw.choice(template_seeds())
    for _ in range(draw.integer(1, 4)):
        at = draw.integer(0, len(text))
        op = draw.integer(0, 3)
        if op < 2:
            text = text[:at] + draw.choice(FRAGMENTS) + text[at:]
        elif op == 2:
            text = text[:at] + text[at + draw.integer(1, 40):]
        else:
            text = text[:at] + chr(draw.integer(0, 0x2FF)) + text[at:]
    return text


@functools.lru_cache(maxsize=None)
def _tiny_tokenizer():
    from ingot.llm.tokenizer import Tokenizer
    return Tokenizer(_hostile().tokenizer_metadata())


def template_target(template: str) -> None:
    from ingot.llm.chat import render_chat
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    text = render_chat(template, messages, bos_token="<s>", eos_token="</s>")
    _tiny_tokenizer().encode(text, add_special=False)


# -- viewer HTTP ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def viewer_server():
    """A viewer server for a tiny package, bound before any fork; each child serves one request."""
    from ingot.viewer import open_model
    from ingot.viewer.server import model_server
    h = _hostile()
    folder = temporary_folder("seeds-")
    return model_server(open_model(str(h.tiny_package(folder / "p.ingot"))))


def viewer_case(draw: Draw) -> bytes:
    port = viewer_server().port
    method = draw.choice(["GET", "GET", "GET", "HEAD", "POST", "PUT", "OPTIONS", "G\0T", "", "GET " * 50])
    path = draw.choice(["/", "/static/viewer.js", "/static/../../etc/passwd", "/api/graph", "/api/constant/0",
                        "/api/constant/1", "/api/constant/3", "/api/constant/999999999", "/api/constant/-1",
                        "/api/constant/00000000001", "//api/graph", "/%2e%2e/", "/?" + "a=" * 2000, "*",
                        "/" + "x" * 70000, "/api/constant/1?x=\xff", "http://evil/api/graph"])
    host = draw.choice([f"127.0.0.1:{port}", f"localhost:{port}", "evil.example", "", f"127.0.0.1:{port}\r\nHost: x"])
    version = draw.choice(["HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "", "HTTP/1.1 extra"])
    headers = [f"Host: {host}"] if not draw.chance(6) else []
    for _ in range(draw.integer(0, 3)):
        headers.append(draw.choice(["Content-Length: 99999999999", "Content-Length: -1", "Transfer-Encoding: chunked",
                                    "Connection: keep-alive", "X: " + "y" * 70000, "Range: bytes=0-1", "Expect: 100-continue"]))
    request = f"{method} {path} {version}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
    data = request.encode("latin-1", "replace")
    if draw.chance(3):
        data = mutate_bytes(draw, data, rounds=3)
    return data


def viewer_target(request: bytes) -> None:
    """Serve one request on the parent's listening socket: the answer must be an HTTP status below 500
    (or the connection closed on a request http.server itself rejects as malformed)."""
    import sys
    server = viewer_server()
    errors = []
    server.httpd.handle_error = lambda request, address: errors.append(sys.exc_info()[1])
    if server.thread is None or not server.thread.is_alive():   # (a long-mode worker serves many cases)
        server.start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=8) as conn:
        try:
            conn.sendall(request)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed first: judged by what it answered
        answer = b""
        while True:
            try:
                chunk = conn.recv(65536)
            except (ConnectionResetError, OSError):
                break
            if not chunk:
                break
            answer += chunk
            if len(answer) > 1 << 24:
                break
    if errors:
        raise AssertionError(f"the viewer's handler raised {type(errors[0]).__name__}: {errors[0]}")
    status = answer.split(b"\r\n", 1)[0]
    parts = status.split()
    if not status.startswith(b"HTTP/"):
        return  # closed without an answer (an empty request), or an HTTP/0.9 reply (a body, no status)
    if len(parts) < 2 or not parts[1].isdigit():
        raise AssertionError(f"the viewer answered {status[:80]!r}")
    if int(parts[1]) >= 500 and int(parts[1]) != 501:  # 501: http.server's answer to a method it does not know
        raise AssertionError(f"the viewer answered {status[:80]!r} to {request[:120]!r}")


LOADERS: dict[str, Loader] = {
    "gguf": Loader("gguf", gguf_case, gguf_target, gguf_seeds),
    "onnx": Loader("onnx", onnx_case, onnx_target, onnx_seeds),
    "package": Loader("package", package_case, package_target, package_seeds),
    "audio": Loader("audio", audio_case, audio_target, audio_seeds),
    "template": Loader("template", template_case, template_target, template_seeds),
    "viewer": Loader("viewer", viewer_case, viewer_target, viewer_server, warm=False),
}
