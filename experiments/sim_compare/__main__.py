"""``python -m experiments.sim_compare``: the study's command."""

from experiments.sim_compare.study import main

if __name__ == "__main__":
    main()
