"""Several devices and processes: the mesh, the logical-axis rules table, shardings.

Modules: `partitioning` (the one mesh function, the rules table on Flax's
logical partitioning, parameter and state shardings), `sharding` (batch
placement, CPU cores as devices), `distributed` (several processes).
"""

from jaxformer.parallel.partitioning import (LOGICAL_AXIS_RULES, make_mesh, param_shardings,
                                             place_params)
from jaxformer.parallel.sharding import (data_sharding, replicate, shard_batch,
                                         use_cpu_cores_as_devices)

__all__ = ["LOGICAL_AXIS_RULES", "make_mesh", "param_shardings", "place_params",
           "data_sharding", "replicate", "shard_batch", "use_cpu_cores_as_devices"]
