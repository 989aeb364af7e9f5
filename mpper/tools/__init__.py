"""What a user runs on a finished or live run: ``--evaluate`` (greedy episodes),
``--on-snapshot`` (a network judged on stored data), ``--inspect`` and ``--plot``."""
