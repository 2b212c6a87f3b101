"""``python -m nanovllm.run``: the research harness's Hydra entry point, kept at this short name because users
type it. Everything lives in :mod:`nanovllm.harness.run`."""

from nanovllm.harness.run import main

if __name__ == "__main__":
    main()
