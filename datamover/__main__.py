"""``python -m datamover``: the same CLI as the ``datamover`` command."""

import sys

from .cli import main

sys.exit(main())
