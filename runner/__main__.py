"""Entry point: ``python3 -I -S /path/to/runner/__main__.py --workspace DIR``.

``-I`` leaves the script's directory off ``sys.path``, so the directory that
holds the ``runner`` package is put there before importing it.  The same file
serves ``python3 -m runner``.
"""

import os
import sys

if __name__ == "__main__":
    _package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _package_parent not in sys.path:
        sys.path.insert(0, _package_parent)
    from runner.server import main

    sys.exit(main(sys.argv[1:]))
