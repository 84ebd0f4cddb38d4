"""What runs inside the training step: the probe guard, the hooks of a sampled step, the sampling
schedule, device-side measurement and its decoding into columns, the sentinels and the losses."""
