"""``python -m tfmem``: the ``tfmem`` command line (see ``tfmem.cli``)."""

import sys

from tfmem.cli import main

sys.exit(main())
