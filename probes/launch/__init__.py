"""Zero code: `modscope run` runs a training script unchanged (autorun) and finds what it trains (autowatch)."""
