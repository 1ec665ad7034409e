"""Lightning glue: LightningModules, the RL DataModule, callbacks and the trace-rl CLI."""
