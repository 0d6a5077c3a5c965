"""`ingot serve`: an OpenAI-compatible HTTP server with continuous batching over KV slots, prefix
reuse and per-request LoRA adapters.

    engine.py     KV slots (batch-1 decoder states), the scheduler thread, prefix reuse
    adapters.py   every served adapter in one decode batch, gathered per row
    app.py        the OpenAI API on FastAPI (validation, SSE streaming, errors)
    metrics.py    Prometheus metrics

    >>> from ingot.serve import serve                                    # doctest: +SKIP
    >>> serve(port=8000, max_batch=8, loras={"pirate": ("adapters/pirate", 1.0)})  # doctest: +SKIP
"""
from __future__ import annotations

import sys
from typing import Callable

from ..errors import IngotError


def parse_lora(text: str) -> tuple[str, str, float]:
    """"NAME=PATH[:SCALE]" -> (name, path, scale)."""
    from ..adapters import parse_lora_arg

    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise IngotError(f"--lora takes NAME=PATH[:SCALE], not {text!r}.")
    if not all(c.isalnum() or c in "-_." for c in name) or len(name) > 64:
        raise IngotError(f"--lora name {name!r} must be 1..64 letters, digits, '-', '_' or '.'.")
    path, scale = parse_lora_arg(rest)
    return name, path, scale


def serve(model: str | None = None, host: str = "127.0.0.1", port: int = 8000, device: str = "cpu", max_batch: int = 8,
          context: int | None = None, loras: dict[str, tuple[str, float]] | None = None, max_queue: int = 64,
          announce: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
          gemv_activations: str | None = None, kv_dtype: str | None = None,
          prefill_precision: str | None = None, threads: int | None = None) -> None:
    """Load the model (the default one when None), then serve it until interrupted. gemv_activations,
    prefill_precision, threads: see CompileOptions.from_command_line (None: INGOT_OPTIONS's choice); kv_dtype: the KV slots' dtype
    (see ingot.llm.load)."""
    import uvicorn

    from ..llm.generate import default_model_path
    from .app import create_app
    from .engine import Engine

    if not 0 <= port <= 65535:
        raise IngotError(f"--port must be 0..65535, not {port}.")
    from ..options import CompileOptions

    options = CompileOptions.from_command_line(gemv_activations, prefill_precision, threads)
    engine = Engine(model or default_model_path(), device=device, max_batch=max_batch, context=context, loras=loras,
                    max_queue=max_queue, options=options, kv_dtype=kv_dtype)
    app = create_app(engine)
    engine.start()
    engine.warm()       # every decode bucket and prefill length compiled before the first request
    models = ", ".join(app.state.model_ids)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    original = server.startup

    async def startup(sockets=None):
        await original(sockets)
        for s in server.servers:
            for sock in s.sockets:
                address = sock.getsockname()
                announce(f"ingot serve: http://{address[0]}:{address[1]}/v1 (models: {models}; {engine.max_batch} slots, "
                         f"context {engine.context}; {options.cpu.gemv_activations} GEMV activations)")
    server.startup = startup
    try:
        server.run()
    finally:
        engine.stop()

