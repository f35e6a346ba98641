"""The engine-core process: vLLM's scheduler with the capture plan, the tail step, and the rows
onto each request's outputs (`scheduler.py`)."""
