"""The only code that does IO: ExaBGP processes, captures, namespaces, sockets, files.

Each adapter is thin and calls into the pure core (`wire`, `summary`, `security`,
`node`, `selector`).
"""
