"""``python -m studio.train CONFIG [--run-dir DIR]``: the worker entry the GUI starts."""

import sys

from studio.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
