"""The graph viewer: `ingot view PATH` serves a page on 127.0.0.1 showing what the compiler made of a model.

    >>> from ingot.viewer import open_model, export                    # doctest: +SKIP
    >>> model = open_model("SmolLM2-135M-Instruct.Q4_1.gguf")          # doctest: +SKIP
    >>> data = export(model)                                           # the page's JSON  # doctest: +SKIP
    >>> serve(model, port=0, open_browser=False)                       # doctest: +SKIP

Layers: `source` opens a package, GGUF or ONNX file as a compiled Program; `export` turns it into
the page's JSON (nodes, folded blocks, constants, variables, kernel groups per device); `stats`
computes weight previews and quantization statistics; `fusion` says which ops each backend runs as
one kernel; `profile` times each step of a run; `server` serves the static page and the data.
"""
from __future__ import annotations

from .export import export
from .source import Model, open_model

__all__ = ["Model", "open_model", "export", "serve", "write_html"]


def serve(*args, **kwargs):
    from .server import serve as _serve
    return _serve(*args, **kwargs)


def write_html(*args, **kwargs):
    from .server import write_html as _write_html
    return _write_html(*args, **kwargs)
