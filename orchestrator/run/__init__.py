"""One training run: the driver, its metrics and summary, reports, and a finished run's trained model."""
