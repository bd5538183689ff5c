"""``python -m kvlink.bench``: one benchmark worker on stdin/stdout (kvlink.bench.worker)."""

import sys

from .worker import main

sys.exit(main())
