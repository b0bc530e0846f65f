"""The lab: containerlab topologies run without Docker, daemon configs, modelled instances.

`topology` (pure) reads a `.clab.yml`; `configs` (pure) renders ExaBGP, FRR and BIRD
configurations; `runner` builds the namespaces and starts the daemons through
`catsproto.adapters.netns`; `embedded` runs ExaBGP speakers on loopback without root.
"""
