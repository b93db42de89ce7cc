"""Jobs: difftune CLI subprocesses, queued in SQLite, their state read back from processes
and run folders."""
