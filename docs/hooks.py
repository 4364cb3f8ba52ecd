# SPDX-License-Identifier: Apache-2.0
"""MkDocs hooks: the page that holds `<!-- launcher flags -->` gets, in its place, a table of every flag of
shmcommrun per group, read from the launcher's own parser, so that the page cannot fall behind the launcher; and the
benchmarks' plots (benchmarks/results/*.png) become the site's results/, so that the site shows the plots that
benchmarks/RESULTS.md shows, not copies of them."""
import argparse
import glob
import os

MARK = "<!-- launcher flags -->"


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


def on_files(files, config):
    """Adds every plot of benchmarks/results as results/<name>."""
    from mkdocs.structure.files import File

    for path in sorted(glob.glob(os.path.join(RESULTS, "*.png"))):
        files.append(File.generated(config, "results/" + os.path.basename(path), abs_src_path=path))
    return files


def on_page_markdown(markdown, page, config, files):
    """Replaces MARK with the flags' tables."""
    if MARK not in markdown:
        return markdown
    return markdown.replace(MARK, flag_tables())


def flag_tables():
    """One table per group of the launcher's parser: the flag's names, its argument, what it does."""
    from shmcomm.runner import cli

    parser = cli.build_parser()
    out = []
    for group in parser._action_groups:
        rows = [action for action in group._group_actions
                if action.option_strings and action.help != argparse.SUPPRESS]
        if not rows:
            continue
        title = group.title[:1].upper() + group.title[1:]
        out += ["### " + title, "", "| flag | argument | meaning |", "|---|---|---|"]
        for action in rows:
            names = ", ".join("`%s`" % name for name in action.option_strings)
            metavar = action.metavar or action.dest.upper()
            metavar = " ".join(metavar) if isinstance(metavar, tuple) else metavar
            argument = "" if action.nargs == 0 else "`%s`" % metavar
            meaning = " ".join((action.help or "").replace("%%", "%").replace("|", "\\|").split())
            out.append("| %s | %s | %s |" % (names, argument, meaning))
        out.append("")
    return "\n".join(out)
