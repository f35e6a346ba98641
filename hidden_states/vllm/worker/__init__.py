"""The worker processes: the worker extension that installs the capture (`extension.py`), the
capture that gathers the scheduler's plan on the device (`capture.py`), and which models'
intermediate layers can be captured (`layers.py`)."""
