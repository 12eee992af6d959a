"""`python -m harness.rft ...` (and `accelerate launch -m harness.rft ...`): see harness/rft/__init__.py."""

import sys

from harness.rft import main

sys.exit(main())
