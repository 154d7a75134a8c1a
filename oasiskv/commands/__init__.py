"""The top-level subcommands that are neither a benchmark, an evaluation nor the server:
`generate`, `pd`, `train-drafter` (each module: `COMMANDS`, `add_arguments`, `run`)."""
