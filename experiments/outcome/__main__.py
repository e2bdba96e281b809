"""``python -m experiments.outcome``: items 1-4 in one run (what ``nox -s outcome`` runs)."""

import sys

from experiments.outcome.run_all import main

if __name__ == "__main__":
    sys.exit(main())
