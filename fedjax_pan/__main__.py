"""`python -m fedjax_pan --config=... --workdir=...`: the command line (`fedjax_pan.run.main`)."""

from fedjax_pan.run.main import main, run  # noqa: F401 - main(argv): the command, in-process

if __name__ == "__main__":
    run()
