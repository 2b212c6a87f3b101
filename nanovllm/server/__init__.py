"""``python -m nanovllm.serve``: nano-vllm behind an OpenAI-compatible HTTP API (FastAPI on uvicorn).

One module a job: ``config`` (the ``server.*`` options), ``protocol`` (the request bodies, strict pydantic
models, and the response shapes), ``errors`` (the OpenAI error object and the exception handlers),
``detokenizer`` (incremental text with stop strings), ``engine_loop`` (the engine stepping in its own thread,
continuous batching across HTTP requests, the run's records), ``prometheus`` (``GET /metrics``), ``app`` (the
routes) and ``main`` (the Hydra entry point, signals and shutdown). The package is a front door: it imports the
engine core and the harness, and neither imports it (import-linter checks it).
"""
