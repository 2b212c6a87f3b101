"""``python -m nanovllm.viz RUN_DIR [RUN_DIR ...] [--out DIR]``: the harness's static report, kept at this short
name because users type it. Everything lives in :mod:`nanovllm.harness.viz`."""

from nanovllm.harness.viz.__main__ import main

if __name__ == "__main__":
    main()
