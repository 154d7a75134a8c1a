"""Training that drives the engine: `drafter.py` trains an EAGLE-style draft head
(`oasiskv train-drafter`). It sits above the engine; `spec` (the drafters) sits below it."""
