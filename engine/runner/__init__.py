"""Turns a SchedulerOutput into tensors, runs the model, samples: the only layer that
touches torch tensors."""
