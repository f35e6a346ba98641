"""`python -m hidden_states.vllm.patches [--check]`: the drift check of every point's symbols (drift.py)."""

from hidden_states.vllm.patches.drift import main

raise SystemExit(main())
