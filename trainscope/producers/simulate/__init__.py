"""A simulated training cluster for the demo, the tests and the benchmarks."""

from trainscope.producers.simulate.cluster import ClusterSpec, SimulatedCluster, StepOutput
from trainscope.producers.simulate.faults import Fault, FaultSpecError, parse_fault, parse_faults
from trainscope.producers.simulate.layout import Layout

__all__ = [
    "ClusterSpec",
    "Fault",
    "FaultSpecError",
    "Layout",
    "SimulatedCluster",
    "StepOutput",
    "parse_fault",
    "parse_faults",
]
