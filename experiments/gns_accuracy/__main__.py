"""``python -m experiments.gns_accuracy``: the study's command."""

from experiments.gns_accuracy.study import main

if __name__ == "__main__":
    main()
