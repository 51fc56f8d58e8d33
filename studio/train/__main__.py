"""``python -m studio.train CONFIG [--run-dir DIR] | --resume DIR``: the worker entry the GUI starts."""

import sys

from studio.train.entry import main

sys.exit(main())
