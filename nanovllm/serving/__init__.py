"""The serving layer every driver shares, between the engine core and its front doors.

``loop`` (``StepLoop``: drives an ``EngineClient`` step by step and keeps the run's books), ``records`` (the
request and step records, and the one writer and reader of a run's files), ``metrics`` (TTFT, TPOT, ITL, goodput,
...), ``monitor`` (MFU/MBU from the built model's cost), ``loggers`` (jsonl, W&B: what sees every step and
request as it happens) and ``formatting``. ``LLM.generate`` (``nanovllm.llm``), the research harness's serving
loop (``nanovllm.harness.serving``) and the HTTP server's engine thread (``nanovllm.server.engine_loop``) all
stand on it; it imports neither the harness nor the server (checked by import-linter).
"""
