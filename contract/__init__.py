"""The contract between Tandoor's halves: what the compiler writes and the agent reads.

Both halves import this package and nothing of each other; the agent's install carries it.
"""
