"""Tooling around the serving system, the top layer (tools -> cluster -> actors -> protos | specdec): the
`specdec` command line (commands.py), `specdec bench-served` (served_bench.py), `specdec soak`
(soak.py), and the benchmark scripts in bench/ whose outputs are in docs/bench/."""
