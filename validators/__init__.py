"""veritrain validators."""
