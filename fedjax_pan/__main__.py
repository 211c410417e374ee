"""`python -m fedjax_pan --config=... --workdir=...`: the command line (`fedjax_pan.run.main`)."""

from fedjax_pan.run.main import run

if __name__ == "__main__":
    run()
