"""``python -m supervisor`` is the ``corral`` command."""

import sys

from supervisor.cli import main

sys.exit(main())
