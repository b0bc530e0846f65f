"""The fault, churn and hostile-peer campaign (issue 11), run against the real lab daemons.

One module per scenario, each a `run(root, *, full=False) -> Result` that brings the
chaos topology (`lab/faults/chaos.clab.yml`) up in namespaces, injects its fault,
measures and tears everything down by PID. `full=True` uses the issue's durations
(a minute of storm, of hostile traffic, of load); the default is the scaled-down run
the tests use. `campaign.run_all` runs them in order and `campaign.table` prints the
chaos table (`catsproto chaos`). lab/faults/README.md and docs/chaos.md have the details.
"""
