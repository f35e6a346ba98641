"""The built-in models (`builtin:NAME`): built on the machine, apart from the serving path.

- `builtin.py`  `resolve_model("builtin:NAME")`: the tests' random-weight models (tiny-llama, tiny-qwen2,
                ..., llama-100m) and the server's default, cached in `~/.cache/hidden-states`;
                `python -m hidden_states.models.builtin NAME ...` builds them and prints their paths;
- `smollm2.py`  SmolLM2-135M-Instruct from a PyPI wheel's GGUF file, dequantized to float32.
"""
