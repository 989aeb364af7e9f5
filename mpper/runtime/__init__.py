"""Running an algorithm: the supervisor and its child processes (self-play workers, the
learner, the evaluator, the reanalyser), the ``--workers 0`` scheduler that runs the
same parts in one process, and what they share: the weight store, samples-per-insert
control, stop signals and the run directory."""
