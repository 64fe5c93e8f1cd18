"""`python -m postrl ...`: the `postrl` command, for machines where the package runs from PYTHONPATH
(a GPU box with src/ on the path) and the console script is not installed."""

import sys

from postrl.cli import main

sys.exit(main())
