"""``python -m rksc_cli``: the ``rksc`` command."""

import sys

from rksc_cli import main

sys.exit(main())
