"""`python -m threefold ...` (also what torchrun runs: `torchrun ... -m threefold train ...`)."""

import sys

from threefold.commands.main import main

sys.exit(main())
