"""``python -m nanovllm.serve``: nano-vllm as an OpenAI-compatible HTTP server, configured like
``python -m nanovllm.run`` (Hydra) plus ``server.*``. Everything lives in :mod:`nanovllm.serve_command`; this module
only makes Ctrl-C (and SIGTERM) end the process with one line from the very start, before torch, transformers,
Hydra and uvicorn are imported (:mod:`nanovllm.harness.interrupt`), and keeps those handlers in charge while
serving (uvicorn installs none of its own)."""

from nanovllm.harness.interrupt import STOP, one_line_interrupts


def main() -> None:
    """Entry point of ``python -m nanovllm.serve`` and the ``nanovllm-serve`` console script."""
    with STOP.installed(), one_line_interrupts():
        STOP.starting("importing torch, transformers, Hydra and uvicorn")
        from nanovllm.serve_command import main as server_main

        server_main()


if __name__ == "__main__":
    main()
