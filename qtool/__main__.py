"""The `qtool` command and `python -m qtool`.

Importing the commands takes a second or more (numpy, onnx, ONNX Runtime, Pillow); a Ctrl-C in
that time is an interruption like any later one: one line and exit code 130, not a traceback
and a death by SIGINT. (A C extension interrupted while it initializes raises ImportError with
the KeyboardInterrupt as its cause.) Everything else is qtool.cli's.
"""
import sys


def _interrupted(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def main(argv=None):
    try:
        from qtool.cli import main as cli_main
    except BaseException as e:
        if not _interrupted(e):
            raise
        sys.stderr.write("qtool: interrupted\n")
        sys.exit(130)
    cli_main(argv)


if __name__ == "__main__":
    main()
