"""One module per `veil` subcommand: `add_parser(subparsers)` and `run(args) -> int`."""
