"""`python -m orchestrator ...`: see orchestrator/cli.py."""

import sys

from orchestrator.cli import main

sys.exit(main())
