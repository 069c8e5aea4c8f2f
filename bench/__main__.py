"""`python -m bench ...`: the load generator from a source checkout, as `stoker bench ...`, and
`python -m bench accuracy ...`, as `stoker accuracy ...` (which find them through the
`stoker.tools` entry points of an installed package)."""

import sys

from bench.cli import main

sys.exit(main(sys.argv[1:]))
