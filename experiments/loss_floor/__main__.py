"""``python -m experiments.loss_floor``: the study's command."""

from experiments.loss_floor.study import main

if __name__ == "__main__":
    main()
