"""`qtool batch`: calibrate, quantize and eval for every model of a catalogue (a TOML file), one job per
model under its own memory limit, and one table of the results (Markdown and JSON).

catalogue.py reads and checks the file; run.py plans the jobs (each entry's three command lines come
from qtool.commands.batch_steps, which parses them with the commands themselves) and writes the table
(table.py); job.py runs one model's steps as watched child processes (watch.py) and makes its row;
local.py and on_ray.py schedule the jobs, here or one Ray task per model. docs/catalogue.md documents
the file.
"""
