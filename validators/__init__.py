"""veritrain validators: the validator role (checks, spot checks, aggregation step, node)."""
