"""The scripts' argparse formatter: the module docstring as written, and every option's default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` keeps the description's line breaks and appends "(default: ...)" to each option."""
