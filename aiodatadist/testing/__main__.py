"""``python -m aiodatadist.testing``: the peer process (see :mod:`aiodatadist.testing.peer`)."""

import sys

from ._child import main

sys.exit(main())
