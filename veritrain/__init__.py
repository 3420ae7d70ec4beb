"""veritrain veritrain."""
