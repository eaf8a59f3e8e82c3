"""Executors for delegated orders (docs/bundle-format.md): each builds one order and runs it."""
