"""Telemetry: the cost model (FLOPs, bytes, KV sizing), step and request stats, Prometheus,
measured device ceilings. Pure Python except ceilings' measurement, which imports torch lazily."""
