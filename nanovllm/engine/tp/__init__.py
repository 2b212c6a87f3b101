"""Tensor parallelism: the driver-side runner (``runner.py``) and the worker processes it starts (``worker.py``).
The layers and the sharding of the model are in ``nanovllm/models/parallel.py``."""
