"""The frontend process (the Serve replica, vLLM's AsyncLLM): OpenAI routes with the vectors
(`openai.py`), and the rows taken off the engine core's outputs, with the extraction step where a
wanted position was not computed (`extraction.py`)."""
