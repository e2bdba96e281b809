"""``python -m experiments.noise_match``: the study's command."""

from experiments.noise_match.study import main

if __name__ == "__main__":
    main()
