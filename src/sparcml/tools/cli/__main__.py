"""``python -m sparcml.tools.cli``: the ``sparcml`` command."""

import sys

from . import main

sys.exit(main())
