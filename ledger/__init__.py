"""veritrain ledger."""
