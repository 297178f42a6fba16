"""The run report: plots of a run's metrics and a per-role timeline of one step, as an HTML page.

Run machinery, read-only over a run's output directory (`xray.run.outputs`): `panels` says
which metrics each plot draws, `plots` and `gantt` draw them with matplotlib, `page` writes the
HTML, `write` puts it together (`write_report`). `python -m xray.report RUN_DIR` writes
`RUN_DIR/report/index.html`; a run writes it when it ends (`trainer.report`).
"""
