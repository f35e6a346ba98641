"""An alias: the drift check lives in hidden_states/vllm/patches/ (`python -m hidden_states.vllm.patches --check`);
`python -m hidden_states.vllm.drift --check` runs the same."""

from hidden_states.vllm.patches.drift import main

if __name__ == "__main__":
    raise SystemExit(main())
