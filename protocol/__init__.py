"""veritrain protocol: the rules every role applies, sans I/O (no network, no database)."""
