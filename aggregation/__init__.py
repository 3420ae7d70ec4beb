"""veritrain aggregation."""
