"""Running a bundle: the runtime (the TVM VM with one executor per order), the executors, and
measuring a bundle's subgraphs on this board (profile)."""
