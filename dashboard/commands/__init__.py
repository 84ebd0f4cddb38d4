"""The `modscope` subcommands behind dashboard/cli.py: each parses its arguments, checks them and wires
the read side or the web app."""
