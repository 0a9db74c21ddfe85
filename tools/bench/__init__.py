"""Benchmark scripts, each run from the repository root as `python -m tools.bench.<name>` (its docstring
says how); their outputs are kept in docs/bench/. shared-pair.yaml serves the bench pair in ../shared
(the models and prompts the measurements in README.md and docs/ used)."""
