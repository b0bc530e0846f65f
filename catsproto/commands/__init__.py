"""Subcommands of `catsproto` beyond the codec's, one module each.

Every module here defines `register(subparsers)`, which adds its parser(s) and sets
`func` to a callable taking the parsed arguments and returning an exit status. The CLI
finds the modules by listing this package, so adding a command touches no shared file.
"""


class UsageError(Exception):
    """Input a command cannot use: the CLI prints it as one line and exits with 2."""
