"""`python -m harness.rft ...` (and `accelerate launch -m harness.rft ...`): see harness/tools/rft.py."""

import sys

from harness.tools.rft import main

sys.exit(main())
