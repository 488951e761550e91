"""``python -m offloadopt``: the same as the ``offloadopt`` console script."""

import sys

from offloadopt.cli import main

sys.exit(main())
