"""Training tasks: model factory, data and loss for one kind of run."""
