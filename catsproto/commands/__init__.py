"""Subcommands of `catsproto` beyond the codec's, one module each.

Every module here defines `register(subparsers)`, which adds its parser(s) and sets
`func` to a callable taking the parsed arguments and returning an exit status. The CLI
finds the modules by listing this package, so adding a command touches no shared file.
"""
