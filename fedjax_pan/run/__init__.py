"""Running a config: assembly from config to round, the training loop, resuming, reports,
experiments over variants, the command line and its multi-process launcher."""
