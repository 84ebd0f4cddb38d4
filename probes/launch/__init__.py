"""Ways in without editing the training loop: `modscope run` (autorun, autowatch) and the notebook."""
