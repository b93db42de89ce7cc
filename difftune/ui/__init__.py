"""difftune ui: a local web app over the same CLI and files.

Jobs are `difftune` CLI subprocesses started in their run folders; every state the app shows
is read back from processes and files (metrics.jsonl, samples/, checkpoints/, the job's exit
record), never kept only in memory, so a restart of the app or a crash of a run cannot leave
the page disagreeing with what is on disk. Built on NiceGUI (FastAPI underneath, Vue/Quasar,
ECharts, AG Grid and CodeMirror shipped inside its wheel).
"""
