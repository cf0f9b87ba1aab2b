"""``python -m attnlab.cli`` (what ``torchrun ... -m attnlab.cli`` runs): the ``attnlab``
command line, as ``python -m attnlab``."""

import sys

from attnlab.cli import main

sys.exit(main())
