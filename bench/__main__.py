"""`python -m bench ...`: the load generator from a source checkout, as `stoker bench ...`
(which finds it through the `stoker.tools` entry point of an installed package)."""

import sys

from bench.cli import main

sys.exit(main(sys.argv[1:]))
