"""Data loading for the training application: samplers and the data-loader factory."""
