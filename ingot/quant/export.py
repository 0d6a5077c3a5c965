"""A model's float weights written back as an F32 GGUF file with the source file's metadata, so
that other tools (llama.cpp's quantizer in `python -m benchmarks quant`) start from the same floats
as Ingot's quantizers.

    from ingot.llm.package import open_model
    from ingot.quant.pipeline import float_weights
    write_float_gguf("model.Q4_1.gguf", dict(float_weights(open_model("model.Q4_1.gguf"))), "model.f32.gguf")
"""
from __future__ import annotations

import numpy as np


def write_float_gguf(source_path: str, floats: dict, out) -> None:
    """An F32 GGUF at out holding `floats` (GGUF names -> float arrays, matrices [out, in]) in the
    source file's tensor order, with the source's metadata (tokenizer and chat template included)."""
    import gguf

    reader = gguf.GGUFReader(source_path)
    architecture = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(out), architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment", "general.file_type"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(floats[t.name], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
