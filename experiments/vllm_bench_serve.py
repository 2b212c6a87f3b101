"""vLLM's own benchmark client (``vllm bench serve``), run with vLLM's virtualenv against any OpenAI-compatible
server, ours included (docs/server.md has the commands and results)::

    taskset -c 0 ~/vllm-venv/bin/python experiments/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:8000 --model <model dir> --served-model-name SmolLM2-135M-Instruct \\
        --dataset-name random --random-input-len 64 --random-output-len 64 --num-prompts 32 --ignore-eos

Every argument is vLLM's (``--help``). This file only calls its ``add_cli_args`` and ``main``: the CPU wheel's
``vllm`` command fails at start, and ``vllm.benchmarks.serve`` has no ``__main__``. It imports nothing of
nano-vllm, so it runs under vLLM's virtualenv (recipe: experiments/bench_vs_vllm.py)."""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
