"""Link traces shipped with splitinfer (CSV files; see README.md here).

This is a package only so that wheels carry the CSV files as package data. Load a
trace with ``splitinfer.netem.load_trace("demo")`` (a shipped name or a CSV path).
"""
