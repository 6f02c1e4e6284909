"""Process groups over torch.distributed (the platform's backend) and this rank's tensor-parallel place.

The collectives themselves are ops of the dispatch layer (``ops.all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``; turnout/ops/reference/collectives.py), called by the layers with the
group of their ``TPGroup``."""

from turnout.distributed.parallel_state import (
                                                SINGLE,
                                                TPGroup,
                                                current_tp_group,
                                                destroy_distributed,
                                                free_port,
                                                init_distributed,
)

__all__ = ["SINGLE", "TPGroup", "current_tp_group", "destroy_distributed", "free_port", "init_distributed"]
