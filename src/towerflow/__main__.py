"""``python -m towerflow`` runs the command line."""

import sys

from towerflow.cli import main

sys.exit(main())
