"""``python -m experiments.time_to_target``: the study's command."""

from experiments.time_to_target.study import main

if __name__ == "__main__":
    main()
