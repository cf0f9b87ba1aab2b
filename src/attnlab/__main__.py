"""``python -m attnlab``: the ``attnlab`` command line."""

import sys

from attnlab.cli import main

sys.exit(main())
