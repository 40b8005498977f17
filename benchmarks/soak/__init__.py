"""Long runs of a fleet under faults: soak, compose soak, fault campaign."""
