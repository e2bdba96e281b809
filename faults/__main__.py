"""``python -m faults``: run the fault-injection trials."""

import sys

from faults.run import main

sys.exit(main())
