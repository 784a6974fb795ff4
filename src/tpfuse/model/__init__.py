"""Performance model of the fused ops: hardware profiles, chunk costs, and a pipeline simulator.

``hardware``: profiles with sourced numbers and calibration overrides; ``cost``: GEMM roofline with
a shape-dependent efficiency curve and alpha-beta transfers; ``simulate``: a discrete-event replay
of one fused op on W ranks; ``knobs``: the fused strategy's per-shape choices (pieces per rank, SM
budget), which dispatch and the planner share.  Nothing here needs a GPU.
"""

from tpfuse.model.hardware import HardwareProfile, detect, get_profile

__all__ = ["HardwareProfile", "detect", "get_profile"]
