"""Graph builders for model families, and the registry of decoder families by GGUF architecture.

    family("gemma3")                  -> the module that builds it (ingot.models.gemma)
    config_from_gguf(model)           -> its config (GemmaConfig, ...) from the GGUF metadata, or one
                                         IngotError naming an architecture no family reads
    build(cfg, tensors, path, ...)    -> the decoder graph (blocks.DecoderGraph)

Each family module has ARCHITECTURES, `Config` (its config dataclass, with `from_gguf`), GGUF_KEYS (its metadata
table) and `build`; it is imported only when used.
"""
from __future__ import annotations

import importlib

from ..errors import IngotError

# GGUF general.architecture -> family module. Mistral 7B and SmolLM2 files say "llama"; "mistral"
# and "smollm" are kept for files written by other tools.
FAMILIES = {
    "llama": "llama", "mistral": "llama", "smollm": "llama", "smollm3": "llama", "qwen2": "llama", "mistral3": "llama",
    "qwen3": "qwen3", "qwen3moe": "qwen3moe", "phi3": "phi3",
    "gemma2": "gemma", "gemma3": "gemma",
}


def supported() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family(architecture: str, path: str = ""):
    """The module that builds `architecture`; IngotError (one sentence) when none does."""
    name = FAMILIES.get(architecture)
    if name is None:
        where = f"{path}: " if path else ""
        raise IngotError(f"{where}architecture {architecture or '(none)'!r} is not supported "
                         f"(supported: {', '.join(FAMILIES)}).")
    return importlib.import_module(f"{__name__}.{name}")


def config_class(architecture: str, path: str = ""):
    """The config dataclass of `architecture`'s family (its module's `Config`)."""
    return family(architecture, path).Config


def config_from_gguf(model):
    """The family config for a GGUF model (its metadata and tensor table; no weight is converted)."""
    return config_class(model.architecture, model.path).from_gguf(model)


def chat_template(architecture: str) -> str | None:
    """The family's own turn format (a jinja2 chat template) for files that carry none; None: ChatML."""
    name = FAMILIES.get(architecture)
    return None if name is None else getattr(importlib.import_module(f"{__name__}.{name}"), "CHAT_TEMPLATE", None)


def unfused(cfg, tensors, path: str = ""):
    """The tensors as cfg's family builder reads them: a family whose files fuse weights (Phi-3's
    attn_qkv) presents them split (its module's `unfused`); the others' tensors as they are."""
    hook = getattr(importlib.import_module(f"{__name__}.{cfg.family}"), "unfused", None)
    return tensors if hook is None else hook(cfg, tensors, path)


def build(cfg, tensors, path: str = "", **kwargs):
    """The decoder graph of cfg's family (kwargs: adapter_sites, all_logits, batch; see llama.build)."""
    module = importlib.import_module(f"{__name__}.{cfg.family}")
    return module.build(cfg, tensors, path, **kwargs)
