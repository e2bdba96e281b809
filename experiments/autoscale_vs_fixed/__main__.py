"""``python -m experiments.autoscale_vs_fixed``: the study's command."""

from experiments.autoscale_vs_fixed.study import main

if __name__ == "__main__":
    main()
