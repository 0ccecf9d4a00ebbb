"""Subcommands of the `specpage` CLI; each module has add_parser() and run()."""
