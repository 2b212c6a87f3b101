"""Hydra configs of ``python -m nanovllm.run``, shipped inside the package as ``nanovllm.conf``."""
