"""Performance model of the fused ops: hardware profiles, chunk costs, and a pipeline simulator.

``hardware``: profiles with sourced numbers and calibration overrides; ``cost``: GEMM roofline with
a shape-dependent efficiency curve and alpha-beta transfers; ``simulate``: the engine of a
discrete-event replay of one op on W ranks, running the schedule a strategy declares (it imports
no strategy); ``steps``: the steps our strategies' schedules are made of.  Nothing here needs a GPU.
"""

from tpfuse.model.hardware import HardwareProfile, detect, get_profile

__all__ = ["HardwareProfile", "detect", "get_profile"]
