"""Token sources: the ``Engine`` protocol and its implementations."""

from replystream.engine.base import (
    Delta,
    DeltaStream,
    Engine,
    EngineError,
    EngineStats,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
    ToolCallDelta,
)
from replystream.engine.simulated import SimulatedConfig, SimulatedEngine

__all__ = [
    "Delta",
    "DeltaStream",
    "Engine",
    "EngineError",
    "EngineStats",
    "GenerationRequest",
    "RequestRejected",
    "SamplingParams",
    "SimulatedConfig",
    "SimulatedEngine",
    "ToolCallDelta",
]
