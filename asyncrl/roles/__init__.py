"""The roles, each a plain async class behind narrow Protocols: Generator, Scorer, Trainer (with the
Evaluator it runs). The Ray actor wrapper is asyncrl/deploy/actors.py; the training core is asyncrl/training/."""
