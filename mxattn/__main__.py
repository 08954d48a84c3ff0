"""``python -m mxattn``: the same command as the ``mxattn`` console script (``mxattn.cli``)."""

import sys

from mxattn.cli import main

sys.exit(main())
