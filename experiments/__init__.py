"""Scripts reproducing the PAN paper's analysis figures (run as `python -m experiments.<name>`)."""
