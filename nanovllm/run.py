"""``python -m nanovllm.run``: the research harness's Hydra entry point, kept at this short name because users
type it. Everything lives in :mod:`nanovllm.harness.run`; this module only makes Ctrl-C (and SIGTERM) end the
run with one line from the very start, before torch, transformers and Hydra are imported
(:mod:`nanovllm.harness.interrupt`)."""

from nanovllm.harness.interrupt import STOP, one_line_interrupts


def main() -> None:
    """Entry point of ``python -m nanovllm.run`` and the ``nanovllm-run`` console script."""
    with STOP.installed(), one_line_interrupts():
        STOP.starting("importing torch, transformers and Hydra")
        from nanovllm.harness.run import main as harness_main

        harness_main()


if __name__ == "__main__":
    main()
