"""What a user runs on a finished or live run: ``--evaluate`` (greedy episodes),
``--on-snapshot`` (a network judged on stored data), ``--inspect``, ``--plot``, and
``mpper sweep`` (several seeds of one config, with their statistics)."""
