"""``python -m experiments.gns_truth``: the study's command."""

from experiments.gns_truth.study import main

if __name__ == "__main__":
    main()
