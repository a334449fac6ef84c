"""``python -m pallas_norm.bench``: see ``pallas_norm.bench.cli``."""

import sys

from pallas_norm.bench.cli import main

sys.exit(main())
