"""The `dsbd` command line: the top layer, over dsbd_core (algorithm, models, tools) and
deployments (Ray). Every subcommand lives here; nothing below imports it."""
