"""``python -m offloadopt`` and the ``offloadopt`` console script (pyproject.toml names
:func:`main` here): ``offloadopt.cli.main``, and a Ctrl-C that comes before it can handle one.

``cli.main`` handles Ctrl-C once it has installed its handlers; a Ctrl-C before that, while
the command line's own module is still being imported (the first ~0.05 s), ended in a
KeyboardInterrupt traceback and status -2 (a user's find). It ends here as a later one does:
the one ``offloadopt: interrupted`` line and status 130, nothing written. Nothing is imported
before ``offloadopt.cli`` (``signal``'s import alone took 5 ms, a window of its own); what runs
before this module (Python's start, ``site``, ``runpy``) is not offloadopt's to handle.
"""

import sys  # a builtin, loaded as Python starts


def main() -> int:
    """Import the command line and run ``offloadopt.cli.main()``; returns its exit status."""
    try:
        from offloadopt.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt as e:  # before cli.main's handlers: it handles those after
        import signal  # imported by now, unless cli's own import was interrupted before it

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shutdown too ends with the status
        cli = sys.modules.get("offloadopt.cli")  # None: its import was what was interrupted
        if cli is not None and isinstance(e, cli.Terminated):  # SIGTERM, as main says it
            print("offloadopt: terminated (SIGTERM)", file=sys.stderr)
            return 143
        print("offloadopt: interrupted", file=sys.stderr)
        return 130  # cli.py's status for Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
