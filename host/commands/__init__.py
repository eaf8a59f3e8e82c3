"""The `tandoor` commands, one module each (host/cli.py assembles them into the group)."""
