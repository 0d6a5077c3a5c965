"""Tiny valid inputs for every loader, and ways to spoil them: what test_hostile_inputs.py and the
fuzz harnesses (tests/fuzz/) start from. Each builder writes a small file that Ingot loads cleanly;
keyword arguments replace one part with a hostile value."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

# -- GGUF ---------------------------------------------------------------------------------------------

# A byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control tokens.
_BYTE_SYMBOLS = None


def byte_symbols() -> list[str]:
    global _BYTE_SYMBOLS
    if _BYTE_SYMBOLS is None:
        from ingot.llm.tokenizer import _bytes_to_unicode
        _BYTE_SYMBOLS = [_bytes_to_unicode()[b] for b in range(256)]
    return _BYTE_SYMBOLS


MERGES = ["h e", "l l", "he ll", "hell o"]
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def tokenizer_metadata(vocab: int = 270) -> dict:
    """tokenizer.ggml.* for a gpt2 vocabulary of `vocab` tokens (>= 262): bytes, merges, specials, fillers."""
    tokens = byte_symbols() + ["he", "ll", "hell", "hello"] + SPECIALS
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    types = [1] * 260 + [3, 3] + [5] * (vocab - 262)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(MERGES),
            "tokenizer.ggml.bos_token_id": 260, "tokenizer.ggml.eos_token_id": 261}


def llama_metadata(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, context=64) -> dict:
    return {"llama.block_count": n_layers, "llama.embedding_length": dim, "llama.attention.head_count": n_heads,
            "llama.attention.head_count_kv": n_kv_heads, "llama.feed_forward_length": ffn_dim,
            "llama.context_length": context, "llama.rope.dimension_count": dim // n_heads,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0}


def llama_tensors(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab=270, seed=0) -> dict:
    """GGUF-named float32 weights [out, in] (numpy order), tied embeddings."""
    rng = np.random.default_rng(seed)
    hd = dim // n_heads
    m = lambda r, c: (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32)  # noqa: E731
    t = {"token_embd.weight": m(vocab, dim), "output_norm.weight": np.ones(dim, np.float32)}
    for i in range(n_layers):
        t.update({f"blk.{i}.attn_norm.weight": np.ones(dim, np.float32), f"blk.{i}.ffn_norm.weight": np.ones(dim, np.float32),
                  f"blk.{i}.attn_q.weight": m(n_heads * hd, dim), f"blk.{i}.attn_k.weight": m(n_kv_heads * hd, dim),
                  f"blk.{i}.attn_v.weight": m(n_kv_heads * hd, dim), f"blk.{i}.attn_output.weight": m(dim, n_heads * hd),
                  f"blk.{i}.ffn_gate.weight": m(ffn_dim, dim), f"blk.{i}.ffn_up.weight": m(ffn_dim, dim),
                  f"blk.{i}.ffn_down.weight": m(dim, ffn_dim)})
    return t


def write_gguf(path, metadata: dict, tensors: dict, arch: str = "llama", raw: dict | None = None) -> str:
    """A GGUF file: metadata values typed by Python type (int -> UINT32 unless negative or big, float ->
    FLOAT32, str, bool, lists), float tensors as F32, and raw = {name: (uint8 [rows, row bytes],
    GGMLQuantizationType)} as they are."""
    import gguf

    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_key_value(key, value, V.BOOL)
        elif isinstance(value, int):
            vt = V.INT64 if value < 0 else (V.UINT32 if value < 2**32 else V.UINT64)
            w.add_key_value(key, value, vt)
        elif isinstance(value, float):
            w.add_key_value(key, value, V.FLOAT32)
        elif isinstance(value, str):
            w.add_key_value(key, value, V.STRING)
        elif isinstance(value, (list, tuple)):
            sub = V.STRING if value and isinstance(value[0], str) else (V.FLOAT32 if value and isinstance(value[0], float) else V.INT32)
            w.add_key_value(key, list(value), V.ARRAY, sub_type=sub)
        else:
            raise TypeError(key)
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array))
    for name, (data, qtype) in (raw or {}).items():  # uint8 [rows, row bytes]
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def tiny_llama_gguf(path, metadata: dict | None = None, drop: tuple = (), vocab: int = 270,
                    quantize: dict | None = None) -> str:
    """A loadable one-layer Llama GGUF with a byte-level tokenizer. metadata: keys to replace (None
    deletes one); drop: tensor names to leave out; quantize: {tensor name: GGMLQuantizationType}."""
    import gguf

    md = {**llama_metadata(), **tokenizer_metadata(vocab)}
    for k, v in (metadata or {}).items():
        if v is None:
            md.pop(k, None)
        else:
            md[k] = v
    md.pop("general.architecture", None)
    tensors = {k: v for k, v in llama_tensors(vocab=vocab).items() if k not in drop}
    raw = {}
    for name, qtype in (quantize or {}).items():
        data = gguf.quants.quantize(tensors.pop(name), qtype)
        raw[name] = (data, qtype)
    return write_gguf(path, md, tensors, raw=raw)


# -- ONNX ---------------------------------------------------------------------------------------------

def onnx_model(nodes, inputs, outputs, initializers=(), opset: int = 17):
    from onnx import helper
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def onnx_add_model(shape=(2, 3)):
    """y = x + w with w an initializer: the smallest model with weights."""
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), "w")
    return onnx_model([helper.make_node("Add", ["x", "w"], ["y"])],
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))], [w])


def onnx_with_external(folder: Path, location: str, offset="0", length=None, data: bytes | None = None):
    """model.onnx in folder whose initializer w (2x3 float) lives in the external file `location`
    (data, when given, is written to folder/location). Returns the model's path."""
    import onnx
    from onnx import TensorProto
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = onnx_add_model()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.ClearField("float_data")
    w.data_location = TensorProto.EXTERNAL
    info = {"location": location, "offset": offset}
    if length is not None:
        info["length"] = length
    for k, v in info.items():
        e = w.external_data.add()
        e.key, e.value = k, str(v)
    if data is not None:
        (folder / location).write_bytes(data)
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    return path


# -- packages -----------------------------------------------------------------------------------------

def tiny_package(path) -> Path:
    """A saved package of y = x * 2 + c (a constant)."""
    import ingot
    g = ingot.Graph()
    x = g.placeholder((2, 3), name="x")
    c = g.constant(np.ones((2, 3), np.float32), name="c")
    g.compile(targets=[x * 2.0 + c]).save(str(path))
    return Path(path)


def safetensors_bytes(header: dict | str, data: bytes = b"") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def nested_json(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- audio ----------------------------------------------------------------------------------------------

def wav_bytes(samples: np.ndarray, rate: int = 8000) -> bytes:
    """16-bit PCM mono RIFF/WAVE."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(pcm)) + pcm
    return b"RIFF" + struct.pack("<I", len(body)) + body


def sparse_wav(path, data_bytes: int, rate: int = 8000) -> str:
    """A WAV header claiming data_bytes of 16-bit samples, the file extended sparsely to that size
    (no disk blocks are written for the samples: zeros)."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    head = b"RIFF" + struct.pack("<I", min(36 + data_bytes, 2**32 - 1)) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt \
        + b"data" + struct.pack("<I", min(data_bytes, 2**32 - 1))
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + data_bytes)
    return os.fspath(path)


def gguf_tensor_header(path, name: str) -> tuple[int, int]:
    """(byte offset of the tensor's n_dims field, n_dims) in a GGUF file's tensor list."""
    import gguf
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    at = int(t.field.offset) + 8 + len(name.encode())
    n_dims = int(np.frombuffer(open(path, "rb").read()[at:at + 4], "<u4")[0])
    return at, n_dims


def patch_gguf_tensor(path, name: str, dims=None, type_id: int | None = None, offset: int | None = None) -> str:
    """Overwrite a tensor's dims (same count), GGML type id or data offset in place."""
    at, n_dims = gguf_tensor_header(path, name)
    with open(path, "r+b") as f:
        if dims is not None:
            assert len(dims) == n_dims
            f.seek(at + 4)
            f.write(struct.pack(f"<{n_dims}Q", *dims))
        if type_id is not None:
            f.seek(at + 4 + 8 * n_dims)
            f.write(struct.pack("<I", type_id))
        if offset is not None:
            f.seek(at + 8 + 8 * n_dims)
            f.write(struct.pack("<Q", offset))
    return os.fspath(path)
