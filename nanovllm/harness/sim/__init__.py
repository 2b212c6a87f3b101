"""The simulator: the real scheduler, policy and allocator, with the model replaced by a step-time model and
the wall clock by a virtual one (``python -m nanovllm.run runner=sim``).

``step_time`` (the models: calibrated, analytical, profiled, replay, token_cost), ``operator_profile`` (Vidur's
measured GPU operator timings, for ``profiled``), ``hardware`` (descriptions for the analytical model), ``calibrate`` (fit a profile from real runs), ``this_machine`` (this machine's own profile),
``simulate`` (build a simulated engine and serve). The ``runner`` config node is checked in
``nanovllm.harness.runners``.
"""

from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.simulate import Simulation, output_lengths_of
from nanovllm.harness.sim.step_time import STEP_TIME_MODELS, StepTimeModel, register_step_time

__all__ = ["Hardware", "Simulation", "output_lengths_of", "STEP_TIME_MODELS", "StepTimeModel",
           "register_step_time"]
