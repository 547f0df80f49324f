import math
import os
from typing import Any

from django.core.management.base import CommandParser

from ingestion import ingester
from ingestion.spool import Overdue, Spool, Stuck, grace_seconds
from jobs.management.base import (
    JobsCommand,
    bad_input,
    decimal_number,
    failed,
    whole_number,
    write_controls,
)

MAX_WORKERS = 64  # reader processes; more only compete for the same cores


class Command(JobsCommand):
    help = (
        "The spool ingester: apply every valid submission in incoming/ exactly once, move "
        "invalid ones to failed/ with a reason. Without --once it watches the spool."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--spool", help="spool root (default: HOLDFAST_SPOOL_DIR)")
        parser.add_argument(
            "--workers",
            type=whole_number,
            default=2,
            help="reader processes feeding the one writer process (default 2)",
        )
        parser.add_argument("--once", action="store_true", help="exit 0 once incoming/ is empty")
        parser.add_argument(
            "--stuck-after",
            type=decimal_number,
            default=60.0,
            help="exit 1 when work is pending and nothing was applied or quarantined for "
            "this many seconds (default 60)",
        )
        parser.add_argument(
            "--grace",
            type=decimal_number,
            default=None,
            help="exit 1, leaving the file in place, when a file has waited in incoming/ "
            "longer than this many seconds (default HOLDFAST_SPOOL_GRACE_SECONDS, 3600; "
            "0 turns the check off)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not 1 <= options["workers"] <= MAX_WORKERS:
            raise bad_input(f"--workers must be from 1 to {MAX_WORKERS}")
        if not 0 < options["stuck_after"] < math.inf:  # also refuses NaN
            raise bad_input("--stuck-after must be a positive number of seconds")
        grace = grace_seconds() if options["grace"] is None else options["grace"]
        if not 0 <= grace < math.inf:  # also refuses NaN
            raise bad_input("--grace must be 0 (off) or a positive number of seconds")
        if options["spool"] is not None and not os.path.isdir(options["spool"]):
            what = "is not a directory" if os.path.exists(options["spool"]) else "does not exist"
            raise bad_input(f"--spool {options['spool']!r} {what}")
        spool = Spool.from_settings(options["spool"])
        try:
            spool.ensure()
        except OSError as exc:  # HOLDFAST_SPOOL_DIR names a file, or a place we cannot write
            where = "--spool" if options["spool"] else "HOLDFAST_SPOOL_DIR"
            reason = exc.strerror or str(exc)
            message = f"{where} {str(spool.root)!r} is not a usable spool: {reason}"
            raise bad_input(message) from None
        # A terminal gets one self-rewriting line; logs get periodic ingest_progress events.
        progress = ingester.progress_for(self.stderr, write=self._write_progress)
        on_terminal = isinstance(progress, ingester.ProgressLine)
        try:
            result = ingester.run(
                spool,
                ingester.Options(
                    workers=options["workers"],
                    once=options["once"],
                    stuck_after=options["stuck_after"],
                    grace=grace,
                    log_batches=not on_terminal,
                ),
                progress=progress,
            )
        except (Stuck, Overdue) as exc:
            raise failed(str(exc)) from None
        except RuntimeError as exc:
            raise failed(str(exc)) from None
        except OSError as exc:  # incoming/ itself unreadable (its permissions, a lost mount)
            where = exc.filename or str(spool.incoming)
            raise failed(f"the spool cannot be read: {where}: {exc.strerror or exc}") from None
        if options["as_json"]:
            self.emit_json(result)
            return
        self.stdout.write(
            f"{result['applied']} applied, {result['duplicates']} already applied, "
            f"{result['quarantined']} quarantined, {result['pending']} pending "
            f"({result['files_per_s']} files/s)"
        )

    def _write_progress(self, text: str) -> None:
        # Unstyled (Django would colour all of stderr as an error), its \r and erase kept.
        write_controls(self.stderr, text)
