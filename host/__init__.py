"""The workstation's tools: the `tandoor` command (compile, inspect, verify, bench, profile,
keygen, fleet). verify, bench and profile run bundles here with the agent's runtime; the
compiler itself never imports the agent."""
