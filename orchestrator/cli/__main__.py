"""`python -m orchestrator.cli ...`: the same as `diloco ...`."""

import sys

from orchestrator.cli.main import main

sys.exit(main())
