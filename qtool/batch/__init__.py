"""`qtool batch`: calibrate, quantize and eval for every model of a catalogue (a TOML file), one job per
model under its own memory limit, and one table of the results (Markdown and JSON).

catalogue.py reads and checks the file; steps.py turns an entry into the three command lines; job.py
runs one model's steps as watched child processes and makes its row; local.py and on_ray.py schedule
the jobs (here, or one Ray task per model); table.py writes the table. docs/catalogue.md
documents the file.
"""
