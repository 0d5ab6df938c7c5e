"""What crosses between processes: the authenticated channel and safe unpickling (all three processes)."""
