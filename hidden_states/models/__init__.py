"""The built-in models (`builtin:NAME`): built on the machine, apart from the serving path.

- `builtin.py`  `resolve_model("builtin:NAME")`: random-weight test models and the server's default;
- `smollm2.py`  SmolLM2-135M-Instruct from a PyPI wheel's GGUF file, dequantized to float32.
"""
