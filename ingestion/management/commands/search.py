import argparse
from typing import Any

from django.core.management.base import CommandParser

from ingestion.search import DEFAULT_LIMIT, MAX_LIMIT, hit_dict, search
from jobs.management.base import JobsCommand, whole_number


class Command(JobsCommand):
    help = "Full-text search over the fetched artifacts, best match first."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "query",
            nargs="+",
            help="words to find, quoted or not (several are joined by spaces); any text is a "
            "valid query",
        )
        parser.add_argument("--source", help="only artifacts of this source")
        parser.add_argument(
            "--limit",
            type=hit_limit,
            default=DEFAULT_LIMIT,
            help=f"at most this many hits (default {DEFAULT_LIMIT}, at most {MAX_LIMIT})",
        )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parse = parser.parse_args

        def parse_words_last(args: Any = None, namespace: Any = None) -> Any:
            return parse(words_last(parser, list(args or ())), namespace)

        parser.parse_args = parse_words_last  # type: ignore[method-assign]
        return parser

    def handle(self, *args: Any, **options: Any) -> None:
        hits = [
            hit_dict(hit)
            for hit in search(" ".join(options["query"]), options["source"], options["limit"])
        ]
        if options["as_json"]:
            self.emit_json({"count": len(hits), "hits": hits})
            return
        for hit in hits:
            # .4g: SQLite's bm25 ranks are tiny (1e-06), which .4f printed as 0.0000.
            self.stdout.write(f"{hit['rank']:>10.4g}  {hit['title'] or '(untitled)'}")
            self.stdout.write(
                f"            {hit['url']}  ({hit['source']}, artifact {hit['artifact_id']})"
            )
            self.stdout.write(f"            {hit['snippet']}")
        self.stdout.write(f"({len(hits)} hits)")


def hit_limit(text: str) -> int:
    """argparse type for --limit: 1 to MAX_LIMIT hits."""
    value = whole_number(text, "a number")  # ASCII digits only, as every command's numbers
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"--limit must be from 1 to {MAX_LIMIT}")
    return value


def words_last(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the command's own options first and every other word after ``--``:
    a query word such as ``-dogs`` (without the word) is not an option argparse does not
    know (docs/sources.md: ``search cats -dogs``)."""
    options: list[str] = []
    words: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            words.extend(tokens)
            break
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        if action is None or not token.startswith("-"):
            words.append(token)
            continue
        options.append(token)
        value = next(tokens, None) if "=" not in token and action.nargs != 0 else None
        if value is not None:  # the option's value follows it
            options.append(value)
    return [*options, "--", *words] if words else options
