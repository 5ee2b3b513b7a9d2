"""`python -m dsbd ...` is the `dsbd` console script."""

import sys

from dsbd.cli import main

sys.exit(main())
