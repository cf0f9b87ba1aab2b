"""``python -m devbench NAME [--quick] [--out DIR] [options]``: run one developer benchmark
(``devbench`` says which) and keep the history of the tables it rewrites."""

import sys

from devbench.cli import main

sys.exit(main())
