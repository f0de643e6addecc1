"""``python -m tensorplay_p2p``: the ``tensorplay-p2p`` command."""

import sys

from ._src.cli import main

sys.exit(main())
