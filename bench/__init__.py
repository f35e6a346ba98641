"""Benchmarks of issue 4: what hidden states cost, what the Serve layer costs (against vLLM's own
server and Ray Serve LLM), payload encodings, and a replica's memory. Run `python -m bench --help`."""
