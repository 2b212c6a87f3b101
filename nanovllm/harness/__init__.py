"""The research harness around the engine: what a serving study needs and the engine does not.

``workload/`` (what arrives, when, how long), ``serving`` (the online loop that feeds an ``LLMEngine`` at the
requests' arrival times), ``records`` (the one writer and reader of a run's files), ``metrics`` (TTFT, TPOT,
ITL, goodput, ...), ``monitor`` (MFU/MBU from the built model's cost), ``loggers`` (jsonl, W&B), ``progress``,
``run`` + ``conf_schema`` (the Hydra entry point ``python -m nanovllm.run``), ``sweep`` (multirun summary) and
``viz/`` (plots and report). The engine core never imports anything from here (checked by import-linter).
"""
