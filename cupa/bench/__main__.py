"""``python -m cupa.bench``: see :mod:`cupa.bench` and docs/benchmarks.md."""

import sys

from .cli import main

sys.exit(main())
