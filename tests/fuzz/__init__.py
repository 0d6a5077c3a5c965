"""Fuzz harnesses for Ingot's loaders (issue 31): GGUF, ONNX, packages, audio, chat templates and the
viewer's HTTP server. CI runs a few hundred derandomized cases per loader (tests/fuzz/test_fuzz.py);
`python -m tests.fuzz --minutes N [--loader X]` is the long mode."""
