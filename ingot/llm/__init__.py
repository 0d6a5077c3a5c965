"""Language-model generation on top of Ingot graphs: load a GGUF, generate text.

    >>> import ingot.llm
    >>> llm = ingot.llm.load("model.gguf")                          # doctest: +SKIP
    >>> for token in llm.generate("Tell me a joke", max_tokens=32):  # doctest: +SKIP
    ...     print(token.text, end="", flush=True)
"""
from .generate import LLM, GenerationStats, Token, default_model_path, load  # noqa: F401
