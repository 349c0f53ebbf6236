"""Several devices and processes: the mesh, the logical-axis rules table, shardings.

Modules: `partitioning` (the mesh and the rules table on Flax's logical
partitioning), `sharding` (batch placement), `distributed` (several processes).
"""
