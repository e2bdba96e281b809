"""``python -m experiments.adascale_scale``: the study's command."""

from experiments.adascale_scale.study import main

if __name__ == "__main__":
    main()
