"""``python -m hyperckpt``: the same as the ``hyperckpt`` command."""

from __future__ import annotations

import sys

from hyperckpt._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
