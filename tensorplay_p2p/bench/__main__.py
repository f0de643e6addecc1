"""``python -m tensorplay_p2p.bench``: the benchmark (``--help`` lists its options)."""

import sys

from . import main

sys.exit(main())
