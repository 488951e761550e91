"""One step from the first grad to the new weights: step() as its phases, the start from
grad hooks, the waits, clipping and the GradScaler, the update rule over a bucket."""
