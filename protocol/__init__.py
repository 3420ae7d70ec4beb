"""veritrain protocol."""
