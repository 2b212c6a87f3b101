"""vLLM's own benchmark client (vllm bench serve), called through its add_cli_args/main: the wheel's `vllm`
command fails at start on this CPU build, and vllm.benchmarks.serve has no __main__."""
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args())
