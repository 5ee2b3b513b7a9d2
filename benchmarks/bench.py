"""The benchmark harness, as a script: exactly `dsbd bench` (see dsbd/bench/decode/ and
benchmarks/README.md for what it measures and how to read the results).

    .venv/bin/python benchmarks/bench.py --pair smollm2 --quick
    nice -n 10 .venv/bin/python benchmarks/bench.py --pair qwen-coder --full   # resumable
"""

from __future__ import annotations

import argparse
import sys

from dsbd.bench_command import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/bench.py", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
