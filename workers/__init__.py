"""veritrain workers: the worker node, its masked-round part and its on-disk state."""
