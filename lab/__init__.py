"""Tools over runs: the comparison and its tasks (eval.py), the lm-evaluation-harness adapter
(harness.py), bench.py, the retrofit (retrofit.py). Run them from the project's root, e.g.
`python lab/eval.py out-a out-b`; the reference scripts (train.py, sample.py, prepare_data.py) never
import this package."""
